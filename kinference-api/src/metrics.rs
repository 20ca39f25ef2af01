//! Helpers for the Prometheus metrics both the agent and the gateway export.

use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;

#[cfg(test)]
mod tests;

/// A metric whose `# HELP` / `# TYPE` lines are exposed before its first sample (prometheus-client
/// leaves out a family that has no samples yet), so dashboards and alerts can tell "nothing yet" from
/// "no such metric".
#[derive(Debug)]
pub struct Described<M>(pub M);

impl<M: EncodeMetric> EncodeMetric for Described<M> {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        self.0.metric_type()
    }

    // The point of the wrapper: `Family` answers `true` while it has no series, and the registry then
    // skips its descriptor.
    fn is_empty(&self) -> bool {
        false
    }
}
