//! Choosing a worker: the cluster-wide KV index and the time-to-first-token estimate.
