//! Cluster mode put together: the watched [`ConfigSource`], the Secrets it references, the status
//! writer behind its Lease, and what the gateway's consumers need from them.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::kube::KubeSourceConfig;
use super::lease::{Elector, default_identity};
use super::secrets::SecretValues;
use super::{ConfigSource, ConfigSourceError, Snapshot};
use crate::backend::provider::CredentialResolver;

/// How long start-up waits for the first complete list before serving (closed until then).
const FIRST_SYNC: Duration = Duration::from_secs(10);

/// The running cluster mode.
pub struct Cluster {
    /// The five kinds, watched.
    pub source: ConfigSource,
    /// The referenced Secrets, watched.
    pub secrets: watch::Receiver<Arc<SecretValues>>,
    /// Whether this replica holds the status writer's lease.
    pub leader: watch::Receiver<bool>,
    /// The client everything uses.
    pub client: kube::Client,
    writes: Arc<std::sync::atomic::AtomicU64>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("source", &self.source)
            .field("leader", &*self.leader.borrow())
            .finish()
    }
}

impl Cluster {
    /// Starts the watchers, the Secret watches and (with `write_status`) the lease and the status
    /// writer; waits up to 10 s for the first complete list.
    pub async fn start(config: &KubeSourceConfig) -> Result<Cluster, ConfigSourceError> {
        let client = super::kube::client(config.kubeconfig.as_deref()).await?;
        Ok(Self::start_with_client(client, config).await)
    }

    /// [`Cluster::start`] with an existing client.
    pub async fn start_with_client(client: kube::Client, config: &KubeSourceConfig) -> Cluster {
        let mut source = super::kube::start(client.clone(), &config.namespaces);
        if !source.wait_synced(FIRST_SYNC).await {
            tracing::warn!(namespaces = ?config.namespaces,
                "configuration objects not listed yet; requests are refused until they are");
        }
        let (secrets, task) = super::secrets::start(client.clone(), source.subscribe());
        source.keep(task);
        let (leader_tx, leader) = watch::channel(false);
        let writes = Arc::new(std::sync::atomic::AtomicU64::new(0));
        if config.write_status {
            let elector = Elector {
                namespace: config.lease_namespace(),
                name: config.lease_name.clone(),
                identity: config.identity.clone().unwrap_or_else(default_identity),
                duration: Duration::from_secs(config.lease_duration_s.max(1)),
            };
            source.keep(tokio::spawn(elector.run(client.clone(), leader_tx)));
            source.keep(tokio::spawn(super::status::run(
                client.clone(),
                source.subscribe(),
                leader.clone(),
                Arc::clone(&writes),
            )));
        }
        Cluster {
            source,
            secrets,
            leader,
            client,
            writes,
        }
    }

    /// How many status writes this replica made (only the lease holder writes).
    pub fn status_writes(&self) -> u64 {
        self.writes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Providers' keys from the watched Secrets (in the provider's namespace).
    pub fn credentials(&self) -> CredentialResolver {
        self.credentials_of("InferenceProvider")
    }

    /// Pools' worker keys (`workerCredentials`) from the watched Secrets (in the pool's namespace).
    pub fn pool_credentials(&self) -> CredentialResolver {
        self.credentials_of("InferencePool")
    }

    /// Keys of objects of `kind` (by name) from the watched Secrets, in the object's namespace.
    fn credentials_of(&self, kind: &'static str) -> CredentialResolver {
        let snapshots = self.source.subscribe();
        let secrets = self.secrets.clone();
        Arc::new(move |name: &str, cred: &kinference_crds::CredentialRef| {
            let namespace = {
                let snapshot: Arc<Snapshot> = Arc::clone(&snapshots.borrow());
                snapshot
                    .entry(kind, name)
                    .map(|e| e.object.namespace.clone())?
            };
            let values = Arc::clone(&secrets.borrow());
            values
                .resolve(&namespace, cred)
                .ok()
                .and_then(|v| String::from_utf8(v).ok())
        })
    }
}
