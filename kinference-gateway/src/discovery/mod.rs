//! In-cluster discovery: the gateway's workers and agents from the Kubernetes API.
//!
//! - Workers ([`pods`]): pods matching the worker label selector in the watched namespaces that are
//!   Running and Ready with a pod IP. Pods coming, going, turning (un)ready and being relabelled are
//!   followed with `kube::runtime::watcher` and fed to the router ([`WorkerSink`]) as they happen.
//! - Agents ([`agents`]): the ready endpoints of the agent's headless Service (EndpointSlices).
//! - In picker mode (`picker_service`), the standard `InferenceObjective`s of the watched namespaces,
//!   where their CRD is served ([`objectives`]): the bands requests naming them ask for.
//!
//! Configured by the `kubernetes:` block the Helm chart writes into `gateway.yaml`
//! ([`KubernetesConfig`]); without that block the gateway runs on its static configuration only.
//! Static workers and agents from the file are kept alongside what discovery finds.
//!
//! The router starts with the agents found at start (waited for up to [`AGENT_SYNC_TIMEOUT`]), then
//! follows the [`AgentSet`] as it changes ([`Discovery::follow_agents_into`]): a new endpoint is connected, a removed one
//! dropped with its cache view, and an agent pod replaced on a node (a new IP) is both, with no restart.

pub mod agents;
pub mod objectives;
pub mod pods;
pub mod standard;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::core::DynamicObject;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use parking_lot::Mutex;
use serde::Deserialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::routing::{BuildError, Router, RoutingConfig, RoutingTuning};
use pods::{PodWorker, pod_key, worker_of};

/// How long the gateway waits at start for the first list of agents (and of worker pods).
pub const AGENT_SYNC_TIMEOUT: Duration = Duration::from_secs(10);

/// The `kubernetes:` block of `gateway.yaml` (written by the chart's gateway ConfigMap).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// Namespaces where worker pods are watched.
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// Watch every namespace instead (the chart's `clusterWide`).
    #[serde(default)]
    pub all_namespaces: bool,
    /// Labels a worker pod carries (all must match).
    #[serde(default = "default_worker_selector")]
    pub worker_selector: BTreeMap<String, String>,
    /// Name of the agents' headless Service; no agent discovery without it.
    #[serde(default)]
    pub agent_service: Option<String>,
    /// Its namespace.
    #[serde(default)]
    pub agent_namespace: Option<String>,
    /// The agents' gRPC port when a slice does not name a `grpc` port.
    #[serde(default = "default_agent_port")]
    pub agent_grpc_port: u16,
    /// The name of Kinference's picker Service: standard (`inference.networking.k8s.io/v1`)
    /// `InferencePool`s in the watched namespaces whose `endpointPickerRef` names it are served,
    /// their members' `podIP:port`s workers ([`standard`]), and the standard `InferenceObjective`s
    /// are read ([`objectives`]). None: neither is read.
    #[serde(default)]
    pub picker_service: Option<String>,
    /// The gateway's own Service (in the pod's namespace): its other ready replicas, at the slices'
    /// `admin` port, are the peers it tells what it dispatches (`replicas:`, joined to any static
    /// `replicas.peers`). None: no peers discovered.
    #[serde(default)]
    pub peer_service: Option<String>,
}

/// The gateway Service's port name the replicas' batches go to.
pub const PEER_PORT_NAME: &str = "admin";

fn default_worker_selector() -> BTreeMap<String, String> {
    BTreeMap::from([("kinference.ai/worker".to_string(), "true".to_string())])
}

fn default_agent_port() -> u16 {
    7070
}

impl KubernetesConfig {
    /// The worker selector as a label selector string (`k=v,k2=v2`).
    pub fn label_selector(&self) -> String {
        self.worker_selector
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Why discovery could not start.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// No Kubernetes client (no in-cluster service account, no kubeconfig).
    #[error("kubernetes client: {0}")]
    Client(#[from] kube::Error),
    /// The router could not be built.
    #[error(transparent)]
    Router(#[from] BuildError),
}

/// Where discovered workers go (the [`Router`] in the gateway).
pub trait WorkerSink: Send + Sync + 'static {
    /// A worker is ready.
    fn upsert(&self, worker: &PodWorker);
    /// A worker left or is no longer ready.
    fn remove(&self, url: &str);
}

impl WorkerSink for Router {
    fn upsert(&self, worker: &PodWorker) {
        if !self.upsert_worker(&worker.url, &worker.model) {
            tracing::error!(worker = %worker.url, "worker table full; discovered worker ignored");
            return;
        }
        // The pod's own role (prefill/decode disaggregation) wins over its pool's.
        if let Some(role) = worker
            .labels
            .get(kinference_api::role::ROLE_KEY)
            .and_then(|r| r.parse().ok())
        {
            self.set_role(&worker.url, role);
        }
    }
    fn remove(&self, url: &str) {
        self.remove_worker(url);
    }
}

/// The discovered workers by URL (with their model and pod labels).
pub type WorkerSet = BTreeMap<String, PodWorker>;

/// Endpoints of a Service (the agents, the gateway's peers), and whether the first list has arrived.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointSet {
    /// The first complete list was received.
    pub synced: bool,
    /// `http://address:port` URLs.
    pub urls: BTreeSet<String>,
}

/// The discovered agents (gRPC URLs).
pub type AgentSet = EndpointSet;

/// Running discovery; dropping it stops the watches.
#[derive(Debug)]
pub struct Discovery {
    workers: watch::Receiver<WorkerSet>,
    /// How many worker-pod scopes (namespaces, or all) have delivered their first list, of how many.
    workers_synced: (watch::Receiver<usize>, usize),
    agents: watch::Receiver<AgentSet>,
    peers: watch::Receiver<EndpointSet>,
    objectives: objectives::Objectives,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Discovery {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Discovery {
    /// Starts watching worker pods (fed to `sink`) and, when configured, the agents.
    pub fn start(client: Client, config: &KubernetesConfig, sink: Arc<dyn WorkerSink>) -> Self {
        let (workers_tx, workers) = watch::channel(WorkerSet::new());
        let workers_tx = Arc::new(workers_tx);
        let selector = config.label_selector();
        let mut tasks = Vec::new();
        let scopes: Vec<Option<String>> = if config.all_namespaces || config.namespaces.is_empty() {
            if !config.all_namespaces {
                tracing::warn!(
                    "kubernetes.namespaces is empty: watching worker pods in all namespaces"
                );
            }
            vec![None]
        } else {
            config.namespaces.iter().cloned().map(Some).collect()
        };
        let (synced_tx, synced_rx) = watch::channel(0usize);
        let synced_tx = Arc::new(synced_tx);
        let scope_count = scopes.len();
        let objectives = objectives::Objectives::default();
        for ns in scopes {
            let api: Api<Pod> = match &ns {
                Some(ns) => Api::namespaced(client.clone(), ns),
                None => Api::all(client.clone()),
            };
            if let Some(service) = &config.picker_service {
                // The standard's objectives belong with its pools: read in picker mode only.
                tasks.push(tokio::spawn(objectives::follow(
                    client.clone(),
                    ns.clone(),
                    objectives.clone(),
                )));
                tasks.push(tokio::spawn(standard::follow(
                    client.clone(),
                    ns.clone(),
                    service.clone(),
                    Arc::clone(&sink),
                    Arc::clone(&workers_tx),
                )));
            }
            tasks.push(tokio::spawn(follow_pods(
                api,
                selector.clone(),
                ns,
                Arc::clone(&sink),
                Arc::clone(&workers_tx),
                Arc::clone(&synced_tx),
            )));
        }
        let (peers_tx, peers) = watch::channel(EndpointSet::default());
        if let Some(service) = config.peer_service.clone() {
            let ns = std::env::var("POD_NAMESPACE").unwrap_or_else(|_| "default".to_string());
            tasks.push(tokio::spawn(follow_endpoints(
                client.clone(),
                ns,
                service,
                PEER_PORT_NAME,
                0,
                peers_tx,
            )));
        }
        let (agents_tx, agents) = watch::channel(AgentSet::default());
        if let Some(service) = config.agent_service.clone() {
            let ns = config
                .agent_namespace
                .clone()
                .or_else(|| std::env::var("POD_NAMESPACE").ok())
                .unwrap_or_else(|| "default".to_string());
            tasks.push(tokio::spawn(follow_endpoints(
                client,
                ns,
                service,
                agents::GRPC_PORT_NAME,
                config.agent_grpc_port,
                agents_tx,
            )));
        } else {
            agents_tx.send_replace(AgentSet {
                synced: true,
                urls: BTreeSet::new(),
            });
        }
        Self {
            workers,
            workers_synced: (synced_rx, scope_count),
            agents,
            peers,
            objectives,
            tasks,
        }
    }

    /// The standard `InferenceObjective`s found, updated as they change.
    pub fn objectives(&self) -> objectives::Objectives {
        self.objectives.clone()
    }

    /// The discovered workers, updated as they change.
    pub fn workers(&self) -> watch::Receiver<WorkerSet> {
        self.workers.clone()
    }

    /// The discovered agents, updated as they change.
    pub fn agents(&self) -> watch::Receiver<AgentSet> {
        self.agents.clone()
    }

    /// The gateway's replicas (this one included: see [`crate::routing::replicas`]) at their admin
    /// port, as admin base URLs, updated as they change; `None` without `kubernetes.peer_service`.
    pub fn peer_urls(
        &mut self,
        config: &KubernetesConfig,
    ) -> Option<watch::Receiver<BTreeSet<String>>> {
        config.peer_service.as_ref()?;
        let mut found = self.peers.clone();
        let (tx, rx) = watch::channel(found.borrow().urls.clone());
        self.tasks.push(tokio::spawn(async move {
            while found.changed().await.is_ok() {
                let urls = found.borrow_and_update().urls.clone();
                if tx.send(urls).is_err() {
                    return;
                }
            }
        }));
        Some(rx)
    }

    /// From now on keeps `router`'s agents equal to the discovered ones plus `fixed` (the file's): new
    /// endpoints connected, removed ones dropped with their cache view. Stops with the discovery or
    /// the router.
    pub fn follow_agents_into(&mut self, router: &Arc<Router>, fixed: BTreeSet<String>) {
        let current: BTreeSet<String> = router
            .agent_urls()
            .into_iter()
            .filter(|u| !fixed.contains(u))
            .collect();
        self.tasks.push(tokio::spawn(sync_agents(
            self.agents(),
            Arc::downgrade(router),
            fixed,
            current,
        )));
    }

    /// Waits (at most `timeout`) until every watched scope has delivered its first list of worker pods,
    /// so that a gateway does not report ready with an empty worker table.
    pub async fn initial_workers(&self, timeout: Duration) {
        let (mut rx, scopes) = self.workers_synced.clone();
        if tokio::time::timeout(timeout, rx.wait_for(|n| *n >= scopes))
            .await
            .is_err()
        {
            tracing::warn!(
                ?timeout,
                "no worker pod list from the Kubernetes API yet; serving while it arrives"
            );
        }
    }

    /// The agents once the first list has arrived (or what is known after `timeout`).
    pub async fn initial_agents(&self, timeout: Duration) -> BTreeSet<String> {
        let mut rx = self.agents.clone();
        let _ = tokio::time::timeout(timeout, rx.wait_for(|a| a.synced)).await;
        let set = rx.borrow().clone();
        if !set.synced {
            tracing::warn!(
                ?timeout,
                "no agent list from the Kubernetes API yet; starting without discovered agents"
            );
        }
        set.urls
    }
}

/// Builds the gateway's router from `routing` and, with `kubernetes` (the `kubernetes:` block of
/// `gateway.yaml`), starts discovery feeding it: the agents found at start join the configured ones,
/// workers follow the pods.
pub async fn router_with_discovery(
    routing: RoutingConfig,
    kubernetes: Option<&KubernetesConfig>,
    agent_tls: Option<kinference_api::tls::ClientTls>,
) -> Result<(Arc<Router>, Option<Discovery>), DiscoveryError> {
    let mut routing = routing;
    let fixed: BTreeSet<String> = routing.agents.iter().cloned().collect();
    let Some(kube_config) = kubernetes else {
        let router = Router::with_agent_tls(routing, RoutingTuning::default(), agent_tls)?;
        return Ok((Arc::new(router), None));
    };
    let client = Client::try_default().await?;
    // The router is built after the agents are known but discovery needs it as the worker sink:
    // buffer worker changes in a forwarding sink until the router exists.
    let late = Arc::new(LateSink::default());
    let mut discovery = Discovery::start(
        client,
        kube_config,
        Arc::clone(&late) as Arc<dyn WorkerSink>,
    );
    for url in discovery.initial_agents(AGENT_SYNC_TIMEOUT).await {
        if !routing.agents.contains(&url) {
            routing.agents.push(url);
        }
    }
    let router = Arc::new(Router::with_agent_tls(
        routing,
        RoutingTuning::default(),
        agent_tls,
    )?);
    late.attach(Arc::clone(&router) as Arc<dyn WorkerSink>);
    discovery.initial_workers(AGENT_SYNC_TIMEOUT).await;
    discovery.follow_agents_into(&router, fixed);
    tracing::info!(
        namespaces = ?kube_config.namespaces,
        selector = %kube_config.label_selector(),
        agents = ?router_agents(&discovery),
        "in-cluster discovery started"
    );
    Ok((router, Some(discovery)))
}

/// Keeps the router's agents equal to the discovered ones (plus the `fixed` ones from the file), from
/// `current` (what the router was built with) on, until the router is dropped.
async fn sync_agents(
    mut rx: watch::Receiver<AgentSet>,
    router: Weak<Router>,
    fixed: BTreeSet<String>,
    mut current: BTreeSet<String>,
) {
    loop {
        let set = rx.borrow_and_update().clone();
        if set.synced {
            let Some(router) = router.upgrade() else {
                return;
            };
            apply_agent_set(&router, &fixed, &mut current, &set.urls);
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// Moves the router from the discovered agents `current` to `wanted`: connects the new ones, drops the
/// ones that left (never one of the `fixed` agents of the file).
pub fn apply_agent_set(
    router: &Router,
    fixed: &BTreeSet<String>,
    current: &mut BTreeSet<String>,
    wanted: &BTreeSet<String>,
) {
    for url in current.difference(wanted) {
        if !fixed.contains(url) {
            router.remove_agent(url);
        }
    }
    for url in wanted.difference(current) {
        router.add_agent(url);
    }
    current.clone_from(wanted);
}

fn router_agents(d: &Discovery) -> Vec<String> {
    d.agents.borrow().urls.iter().cloned().collect()
}

/// A sink that queues changes until its target is attached, then forwards them.
#[derive(Default)]
struct LateSink {
    inner: Mutex<LateInner>,
}

#[derive(Default)]
struct LateInner {
    target: Option<Arc<dyn WorkerSink>>,
    queued: Vec<(PodWorker, bool)>,
}

impl LateSink {
    fn attach(&self, target: Arc<dyn WorkerSink>) {
        let mut inner = self.inner.lock();
        for (w, up) in inner.queued.drain(..) {
            if up {
                target.upsert(&w);
            } else {
                target.remove(&w.url);
            }
        }
        inner.target = Some(target);
    }
}

impl WorkerSink for LateSink {
    fn upsert(&self, worker: &PodWorker) {
        let mut inner = self.inner.lock();
        match &inner.target {
            Some(t) => t.upsert(worker),
            None => inner.queued.push((worker.clone(), true)),
        }
    }
    fn remove(&self, url: &str) {
        let mut inner = self.inner.lock();
        match &inner.target {
            Some(t) => t.remove(url),
            None => inner.queued.push((
                PodWorker {
                    url: url.to_string(),
                    ..PodWorker::default()
                },
                false,
            )),
        }
    }
}

/// One namespace's (or all namespaces') worker pods, as seen so far.
struct PodTable {
    by_pod: HashMap<String, PodWorker>,
    sink: Arc<dyn WorkerSink>,
    published: Arc<watch::Sender<WorkerSet>>,
}

impl PodTable {
    /// Pod `key` is now `worker` (None: not a ready worker, or gone).
    fn set(&mut self, key: String, worker: Option<PodWorker>) {
        let old = self.by_pod.get(&key);
        if old == worker.as_ref() {
            return;
        }
        if let Some(old) = old
            && worker.as_ref().is_none_or(|w| w.url != old.url)
        {
            tracing::info!(pod = %key, worker = %old.url, "worker left");
            self.sink.remove(&old.url);
            let url = old.url.clone();
            self.published.send_modify(|s| {
                s.remove(&url);
            });
        }
        match worker {
            Some(w) => {
                tracing::info!(pod = %key, worker = %w.url, model = %w.model, "worker ready");
                self.sink.upsert(&w);
                self.published.send_modify(|s| {
                    s.insert(w.url.clone(), w.clone());
                });
                self.by_pod.insert(key, w);
            }
            None => {
                self.by_pod.remove(&key);
            }
        }
    }

    /// A fresh list replaced everything: pods not in it are gone.
    fn replace(&mut self, listed: HashMap<String, Option<PodWorker>>) {
        let gone: Vec<String> = self
            .by_pod
            .keys()
            .filter(|k| !listed.contains_key(*k))
            .cloned()
            .collect();
        for key in gone {
            self.set(key, None);
        }
        for (key, worker) in listed {
            self.set(key, worker);
        }
    }
}

async fn follow_pods(
    api: Api<Pod>,
    selector: String,
    namespace: Option<String>,
    sink: Arc<dyn WorkerSink>,
    published: Arc<watch::Sender<WorkerSet>>,
    synced: Arc<watch::Sender<usize>>,
) {
    let mut first_list = true;
    let mut table = PodTable {
        by_pod: HashMap::new(),
        sink,
        published,
    };
    let config = watcher::Config::default().labels(&selector);
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    let mut listing: Option<HashMap<String, Option<PodWorker>>> = None;
    while let Some(event) = stream.next().await {
        match event {
            Ok(Event::Init) => listing = Some(HashMap::new()),
            Ok(Event::InitApply(pod)) => {
                if let Some(l) = listing.as_mut() {
                    l.insert(pod_key(&pod), worker_of(&pod));
                }
            }
            Ok(Event::InitDone) => {
                if let Some(l) = listing.take() {
                    table.replace(l);
                }
                if std::mem::take(&mut first_list) {
                    synced.send_modify(|n| *n += 1);
                }
            }
            Ok(Event::Apply(pod)) => table.set(pod_key(&pod), worker_of(&pod)),
            Ok(Event::Delete(pod)) => table.set(pod_key(&pod), None),
            Err(error) => {
                tracing::warn!(namespace = ?namespace, %error, "watching worker pods failed; retrying")
            }
        }
    }
}

/// Follows the ready endpoints of `service` (its EndpointSlices) at the port named `port_name` (else
/// `default_port`) into `published`.
async fn follow_endpoints(
    client: Client,
    namespace: String,
    service: String,
    port_name: &'static str,
    default_port: u16,
    published: watch::Sender<EndpointSet>,
) {
    // The EndpointSlice version the server serves (v1 from Kubernetes 1.21, v1beta1 before).
    let mut backoff = Duration::from_millis(200);
    let resource = loop {
        match kube::discovery::group(&client, "discovery.k8s.io").await {
            Ok(group) => match group.recommended_kind("EndpointSlice") {
                Some((ar, _)) => break ar,
                None => tracing::warn!("the API server serves no EndpointSlice kind"),
            },
            Err(error) => tracing::warn!(%error, "discovering the EndpointSlice API failed"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(10));
    };
    let api: Api<DynamicObject> = Api::namespaced_with(client, &namespace, &resource);
    let selector = format!("{}={service}", agents::SERVICE_NAME_LABEL);
    let config = watcher::Config::default().labels(&selector);
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    let mut by_slice: HashMap<String, BTreeSet<String>> = HashMap::new();
    let mut listing: Option<HashMap<String, BTreeSet<String>>> = None;
    let agents_in = |obj: &DynamicObject| -> BTreeSet<String> {
        match serde_json::from_value::<agents::Slice>(obj.data.clone()) {
            Ok(slice) => agents::endpoints_of(&slice, port_name, default_port),
            Err(error) => {
                tracing::warn!(%error, "unreadable EndpointSlice ignored");
                BTreeSet::new()
            }
        }
    };
    let publish = |by_slice: &HashMap<String, BTreeSet<String>>| {
        let urls: BTreeSet<String> = by_slice.values().flatten().cloned().collect();
        published.send_if_modified(|cur| {
            let changed = !cur.synced || cur.urls != urls;
            if changed {
                tracing::info!(%service, endpoints = ?urls, "service endpoints changed");
                cur.synced = true;
                cur.urls = urls;
            }
            changed
        });
    };
    while let Some(event) = stream.next().await {
        match event {
            Ok(Event::Init) => listing = Some(HashMap::new()),
            Ok(Event::InitApply(obj)) => {
                if let Some(l) = listing.as_mut() {
                    l.insert(
                        obj.metadata.name.clone().unwrap_or_default(),
                        agents_in(&obj),
                    );
                }
            }
            Ok(Event::InitDone) => {
                if let Some(l) = listing.take() {
                    by_slice = l;
                    publish(&by_slice);
                }
            }
            Ok(Event::Apply(obj)) => {
                by_slice.insert(
                    obj.metadata.name.clone().unwrap_or_default(),
                    agents_in(&obj),
                );
                publish(&by_slice);
            }
            Ok(Event::Delete(obj)) => {
                by_slice.remove(obj.metadata.name.as_deref().unwrap_or_default());
                publish(&by_slice);
            }
            Err(error) => {
                tracing::warn!(%namespace, %service, %error, "watching EndpointSlices failed; retrying")
            }
        }
    }
}

#[cfg(test)]
mod tests;
