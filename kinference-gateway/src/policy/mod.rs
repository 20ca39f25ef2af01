//! Inference policies: ordered rules over tenant, model, semantic tags and pool state.
