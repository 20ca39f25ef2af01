//! LoRA adapters: a worker serves its model and the adapters it has loaded. A request naming an adapter
//! (its `"model"`) has as candidates only the workers that list it (learned from their `/v1/models` by
//! [`crate::backend::adapters`]); its prompt's block keys are seeded by the adapter's name, as the agent
//! keys the adapter's cached blocks, so only that adapter's blocks count as hits.

use super::Router;
use super::kv_index::WorkerId;
use super::workers::WorkerTable;

impl WorkerTable {
    /// Whether worker `id` has the adapter `model` loaded.
    pub(super) fn has_adapter(&self, id: WorkerId, model: &str) -> bool {
        self.adapters
            .get(model)
            .is_some_and(|ids| ids.contains(&id))
    }

    /// The adapters worker `id` has loaded, sorted.
    fn adapters_of(&self, id: WorkerId) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .adapters
            .iter()
            .filter(|(_, ids)| ids.contains(&id))
            .map(|(name, _)| name.as_str())
            .collect();
        names.sort_unstable();
        names
    }
}

impl Router {
    /// Every LoRA adapter some worker has loaded, with the model it adapts (its workers' model),
    /// sorted by name.
    pub fn adapters(&self) -> Vec<(String, String)> {
        let table = self.shared.workers.read();
        let mut adapters: Vec<(String, String)> = table
            .adapters
            .iter()
            .filter_map(|(name, ids)| {
                let base = table.by_id(*ids.first()?)?;
                Some((name.clone(), base.model.clone()))
            })
            .collect();
        adapters.sort_unstable();
        adapters
    }

    /// Sets the LoRA adapters `worker` has loaded (sorted); `true` when they changed. Unknown workers
    /// are ignored: the configuration, discovery or an agent adds workers, not this.
    pub fn set_adapters(&self, worker: &str, adapters: Vec<String>) -> bool {
        let id = {
            let table = self.shared.workers.read();
            let Some(w) = table.get(worker) else {
                return false;
            };
            if table.adapters_of(w.id) == adapters.iter().map(String::as_str).collect::<Vec<_>>() {
                return false;
            }
            w.id
        };
        let mut table = self.shared.workers.write();
        for ids in table.adapters.values_mut() {
            ids.retain(|w| *w != id);
        }
        table.adapters.retain(|_, ids| !ids.is_empty());
        for name in adapters {
            table.adapters.entry(name).or_default().push(id);
        }
        true
    }
}

#[cfg(test)]
mod tests;
