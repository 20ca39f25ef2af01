//! `GET /v1/models`: what this gateway serves right now. The served model names (configured, then
//! those of the workers the router knows, discovered ones included, then the policy set's
//! `InferenceModel`s), each model's aliases, the model classes with their members, and the LoRA
//! adapters workers have loaded. Read on every call, so workers discovered, adapters loaded and
//! policies reloaded show at once.

use std::collections::{BTreeMap, BTreeSet};

use crate::api::openai::{ModelCard, ModelKind};
use crate::gateway::Gateway;
use crate::policy::model::PolicySet;

/// Who serves the gateway's own models.
const OWNER: &str = "kinference";

/// The entries of `GET /v1/models`, each name once, models first.
pub fn cards(gw: &Gateway) -> Vec<ModelCard> {
    let workers: Vec<String> = gw.router.workers().into_iter().map(|w| w.model).collect();
    let set = gw.policy.as_ref().map(|stage| stage.current());
    let mut cards = cards_of(&gw.models, &workers, set.as_deref());
    for (adapter, base) in gw.router.adapters() {
        if !cards.iter().any(|c| c.id == adapter) {
            cards.push(ModelCard {
                id: adapter,
                owned_by: OWNER.to_string(),
                kind: ModelKind::Adapter,
                root: Some(base),
                members: Vec::new(),
            });
        }
    }
    cards
}

/// [`cards`] from its sources.
pub fn cards_of(
    configured: &[String],
    worker_models: &[String],
    set: Option<&PolicySet>,
) -> Vec<ModelCard> {
    let mut seen = BTreeSet::new();
    let mut cards = Vec::new();
    let mut push = |card: ModelCard| {
        if seen.insert(card.id.clone()) {
            cards.push(card);
        }
    };
    let served = |id: &str| ModelCard {
        id: id.to_string(),
        owned_by: OWNER.to_string(),
        kind: ModelKind::Model,
        root: Some(id.to_string()),
        members: Vec::new(),
    };
    for name in configured.iter().chain(worker_models) {
        push(served(name));
    }
    let Some(set) = set else {
        return cards;
    };
    for model in set.models.values() {
        push(served(&model.spec.served_name));
    }
    for model in set.models.values() {
        for alias in &model.spec.aliases {
            push(ModelCard {
                id: alias.clone(),
                owned_by: OWNER.to_string(),
                kind: ModelKind::Alias,
                root: Some(model.spec.served_name.clone()),
                members: Vec::new(),
            });
        }
    }
    // Class -> (members, whether a local model is one of them, the providers serving it).
    let mut classes: BTreeMap<&str, (Vec<String>, bool, BTreeSet<&str>)> = BTreeMap::new();
    for model in set.models.values() {
        for class in &model.spec.classes {
            let entry = classes.entry(class).or_default();
            entry.0.push(model.spec.served_name.clone());
            entry.1 = true;
        }
    }
    for provider in set.providers.values() {
        for pm in &provider.spec.models {
            for class in &pm.classes {
                let entry = classes.entry(class).or_default();
                entry
                    .0
                    .push(format!("provider/{}/{}", provider.name, pm.name));
                entry.2.insert(&provider.name);
            }
        }
    }
    for (class, (members, local, providers)) in classes {
        let owned_by = if local || providers.is_empty() {
            OWNER.to_string()
        } else {
            providers.into_iter().collect::<Vec<_>>().join(",")
        };
        push(ModelCard {
            id: class.to_string(),
            owned_by,
            kind: ModelKind::Class,
            root: None,
            members,
        });
    }
    cards
}

#[cfg(test)]
mod tests;
