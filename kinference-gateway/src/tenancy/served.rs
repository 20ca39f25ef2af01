//! Which served model a request's limits and prices belong to, whatever name it asked by.
//!
//! A client may ask for an `InferenceModel` by its name, its served name, an alias, or a class; the
//! worker serves one concrete model. Per-model rate limits (`tenancy.tenants.<t>.models`, keyed by
//! the served name) and prices follow the model actually served: a request by alias counts against
//! the same buckets as one by the served name, and a request by class is admitted only if every
//! model of the class it may land on has room (the others' share is refunded once it is routed).

use std::collections::{BTreeSet, HashMap};

use kinference_crds::InferenceModelSpec;

/// Requested names -> the served models they stand for.
#[derive(Debug, Default, Clone)]
pub(super) struct ServedModels {
    /// `InferenceModel` name, served name and aliases -> served name.
    names: HashMap<String, String>,
    /// Class -> served names of its models.
    classes: HashMap<String, BTreeSet<String>>,
}

impl ServedModels {
    /// Indexes one `InferenceModel`.
    pub(super) fn add(&mut self, name: &str, spec: &InferenceModelSpec) {
        let served = &spec.served_name;
        for n in [name, served.as_str()]
            .into_iter()
            .chain(spec.aliases.iter().map(String::as_str))
        {
            self.names.insert(n.to_string(), served.clone());
        }
        for class in &spec.classes {
            self.classes
                .entry(class.clone())
                .or_default()
                .insert(served.clone());
        }
    }

    /// The served models a request for `asked` may be served by: the one a model name or alias
    /// names, every model of a class, else `asked` itself (no policy objects: the name is served).
    pub(super) fn candidates(&self, asked: &str) -> Vec<String> {
        if let Some(served) = self.names.get(asked) {
            return vec![served.clone()];
        }
        match self.classes.get(asked) {
            Some(members) if !members.is_empty() => members.iter().cloned().collect(),
            _ => vec![asked.to_string()],
        }
    }
}
