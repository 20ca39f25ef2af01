//! The five Kinference custom resources: InferencePool, InferenceModel, InferenceProvider,
//! InferenceTenant and InferencePolicy (group `kinference.ai`, version `v1alpha1`).
#![forbid(unsafe_code)]
