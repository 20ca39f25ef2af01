//! One status writer among gateway replicas, elected with a `coordination.k8s.io/v1` Lease.
//!
//! Every replica serves from its own watchers; only the lease holder writes status, so replicas
//! never fight over `status.conditions`. The holder renews every `duration / 3`; a replica takes
//! the lease over when its `renewTime` is older than `leaseDurationSeconds`. Every write carries
//! the `resourceVersion` it read (optimistic concurrency), so two replicas can never both win.
//! [`Elector::run`] publishes whether this replica holds the lease through a `watch<bool>`.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use tokio::sync::watch;

/// Who this replica is and which lease it competes for.
#[derive(Debug, Clone)]
pub struct Elector {
    /// The Lease's namespace.
    pub namespace: String,
    /// The Lease's name.
    pub name: String,
    /// This replica's identity (unique among replicas).
    pub identity: String,
    /// How long a holder that stopped renewing keeps the lease.
    pub duration: Duration,
}

/// A default identity: `$POD_NAME` or the host name, plus a random suffix.
pub fn default_identity() -> String {
    let base = std::env::var("POD_NAME")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "kinference-gateway".into());
    format!("{base}-{:08x}", rand::random::<u32>())
}

fn now() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

impl Elector {
    /// Competes for the lease until `leader`'s receivers are all gone; `leader` is true while this
    /// replica holds it. On a lost or failed renewal it turns false at once.
    pub async fn run(self, client: Client, leader: watch::Sender<bool>) {
        let api: Api<Lease> = Api::namespaced(client, &self.namespace);
        let period = (self.duration / 3).max(Duration::from_millis(200));
        loop {
            let holding = match self.round(&api).await {
                Ok(h) => h,
                Err(error) => {
                    tracing::debug!(%error, lease = %self.name, "lease round failed");
                    false
                }
            };
            if *leader.borrow() != holding {
                tracing::info!(identity = %self.identity, lease = %self.name, holding, "status writer lease changed hands");
            }
            leader.send_if_modified(|l| std::mem::replace(l, holding) != holding);
            if leader.is_closed() {
                return;
            }
            tokio::time::sleep(period).await;
        }
    }

    /// One attempt: create, renew or take over. Whether this replica holds the lease after it.
    async fn round(&self, api: &Api<Lease>) -> Result<bool, kube::Error> {
        let duration_s = i32::try_from(self.duration.as_secs().max(1)).unwrap_or(i32::MAX);
        let Some(mut lease) = api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    namespace: Some(self.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(duration_s),
                    acquire_time: Some(now()),
                    renew_time: Some(now()),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            return match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        let mine = spec.holder_identity.as_deref() == Some(self.identity.as_str());
        let held_for_ms = i64::from(spec.lease_duration_seconds.unwrap_or(duration_s)) * 1000;
        let expired = spec.renew_time.as_ref().is_none_or(|t| {
            k8s_openapi::jiff::Timestamp::now().as_millisecond() - t.0.as_millisecond()
                > held_for_ms
        });
        if !mine && !expired {
            return Ok(false);
        }
        if !mine {
            spec.holder_identity = Some(self.identity.clone());
            spec.acquire_time = Some(now());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.renew_time = Some(now());
        spec.lease_duration_seconds = Some(duration_s);
        // The replace carries the resourceVersion just read: a concurrent writer gets 409.
        match api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }
}
