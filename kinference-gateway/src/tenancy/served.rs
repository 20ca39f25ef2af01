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
    /// Served name -> the classes its model belongs to.
    classes_of: HashMap<String, BTreeSet<String>>,
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
            self.classes_of
                .entry(served.clone())
                .or_default()
                .insert(class.clone());
        }
    }

    /// Whether a tenant that may use `models` (names or aliases) and `classes` may ask for `asked`,
    /// as the policy engine decides it: the name stands for an allowed model, or is (or stands for
    /// a model of) an allowed class. Both lists empty: every model.
    pub(super) fn allows(&self, asked: &str, models: &[String], classes: &[String]) -> bool {
        if models.is_empty() && classes.is_empty() {
            return true;
        }
        let served = |name: &str| {
            self.names
                .get(name)
                .map_or(name, String::as_str)
                .to_string()
        };
        let asked_served = self.names.get(asked).cloned();
        let model_ok = models
            .iter()
            .any(|m| m == asked || asked_served.as_deref().is_some_and(|s| s == served(m)));
        let class_ok = classes.iter().any(|c| {
            c == asked
                || asked_served
                    .as_ref()
                    .and_then(|s| self.classes_of.get(s))
                    .is_some_and(|of| of.contains(c))
        });
        model_ok || class_ok
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

#[cfg(test)]
mod tests {
    use super::*;

    fn model(served: &str, aliases: &[&str], classes: &[&str]) -> InferenceModelSpec {
        serde_json::from_value(serde_json::json!({
            "servedName": served, "aliases": aliases, "classes": classes,
        }))
        .unwrap()
    }

    #[test]
    fn a_tenant_may_ask_by_any_name_of_an_allowed_model_or_class() {
        let mut s = ServedModels::default();
        s.add("big", &model("big-served", &["large"], &["premium"]));
        s.add("small", &model("small-served", &[], &["cheap"]));
        let models = vec!["big".to_string()];
        for asked in ["big", "big-served", "large"] {
            assert!(s.allows(asked, &models, &[]), "{asked}");
        }
        assert!(!s.allows("small", &models, &[]));
        assert!(!s.allows("premium", &models, &[]), "a class is not a model");
        let classes = vec!["cheap".to_string()];
        assert!(s.allows("cheap", &[], &classes));
        assert!(s.allows("small-served", &[], &classes));
        assert!(!s.allows("big", &[], &classes));
        assert!(!s.allows("unknown", &[], &classes));
        assert!(s.allows("anything", &[], &[]), "no list: every model");
    }
}
