//! `kinference-gateway`: serves the client API and the admin port until SIGINT or SIGTERM.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use kinference_gateway::backend::worker::{Upstream, credentials};
use kinference_gateway::config::{Args, GatewayConfig};
use kinference_gateway::metrics::Metrics;
use kinference_gateway::server::{self, Gateway, Port};
use kinference_gateway::telemetry::Telemetry;
use kinference_gateway::tenancy::PolicyFiles;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    args.http.validate().map_err(anyhow::Error::msg)?;
    let telemetry = Telemetry::init(&args.telemetry)?;
    let config = if !args.workers.is_empty() && !args.config.exists() {
        GatewayConfig::default()
    } else {
        GatewayConfig::load(&args.config)?
    };
    // What every request to a worker carries (its API key, configured headers), from the start:
    // `--worker` asks the workers' `/v1/models` with it.
    let worker_key = credentials::resolve(
        args.worker_api_key.as_deref(),
        config.worker_api_key.as_ref(),
    )
    .map_err(anyhow::Error::msg)?;
    let worker_headers = credentials::worker_headers(worker_key.as_deref(), &config.worker_headers)
        .map_err(anyhow::Error::msg)
        .context("the workers' API key and headers")?;
    let config = kinference_gateway::config::workers_flag::with_flag_workers(
        config,
        &args.workers,
        args.tokenizer_dir.as_ref(),
        &worker_headers,
    )
    .await
    .map_err(anyhow::Error::msg)?;
    // Cluster mode (`crds:`): the five kinds watched in the API server, status written, keys from
    // Secrets. Local mode: the policy stage over a policy directory. Either way the pools'
    // endpoints join the router's workers.
    let mut cluster = match &config.crds {
        Some(crds) => Some(
            kinference_gateway::config_source::cluster::Cluster::start(crds)
                .await
                .context("watching the CRDs in the cluster")?,
        ),
        None => None,
    };
    // Local mode: one source over the policy directory, started once here; the policy stage and
    // tenancy read its snapshots, as both read the cluster's source in cluster mode.
    let local = match &cluster {
        Some(_) => None,
        None => kinference_gateway::config::local_source(&config)
            .context("loading the policy directory")?,
    };
    let policy_files = local
        .as_ref()
        .zip(config.policy_dir.clone())
        .map(|(source, dir)| PolicyFiles {
            dir,
            snapshots: source.subscribe(),
        });
    let (config, pools) = match cluster.as_mut() {
        Some(cluster) => {
            let (config, pools) =
                kinference_gateway::config::with_cluster_policy_stage(config, &args.http, cluster);
            (config, Some(pools))
        }
        None => kinference_gateway::config::with_policy_stage(config, &args.http, local),
    };
    let policy = pools.as_ref().map(|p| Arc::clone(p.stage()));
    let tls_metrics = kinference_api::tls::TlsMetrics::default();
    let agent_tls = args
        .agent_tls
        .load(&tls_metrics)
        .context("loading the agents' mTLS files")?;
    let (router, mut discovery) = kinference_gateway::discovery::router_with_discovery(
        config.routing_config(),
        config.kubernetes.as_ref(),
        agent_tls,
    )
    .await
    .context("building the router")?;
    router.set_pd_min_uncached_tokens(config.disaggregation.min_uncached_tokens);
    // In a cluster the other replicas come from the gateway Service's endpoints (`kubernetes.peer_service`).
    let discovered_peers = match (&mut discovery, &config.kubernetes) {
        (Some(found), Some(kubernetes)) => found.peer_urls(kubernetes),
        _ => None,
    };
    router.set_default_priority_scheduling(
        config.scheduling_policy == kinference_gateway::config::SchedulingPolicyConfig::Priority,
    );
    router.configure_sessions(&config.sessions);
    router.share_with_replicas(
        &config.replicas,
        args.access
            .admin_key
            .as_ref()
            .map(|k| k.expose().to_owned()),
        discovered_peers,
    );
    let metrics = Metrics::new();
    // Served names stay `model` labels even for failed requests; other client-chosen names fold.
    metrics.serve_models(config.model_names());
    metrics.with_registry(|registry| router.register_metrics(registry));
    metrics.with_registry(|registry| tls_metrics.register(registry));
    if let Some(stage) = &policy {
        metrics.with_registry(|registry| stage.register_metrics(registry));
    }
    let _policy_sync = pools
        .as_ref()
        .map(|pools| pools.spawn_sync(Arc::clone(&router)));
    // Pools with a selector pick their workers among the discovered pods.
    if let (Some(stage), Some(discovery)) = (&policy, &discovery) {
        stage.follow_discovered(discovery.workers());
    }
    let tenancy = metrics
        .with_registry(|registry| {
            kinference_gateway::tenancy::Tenancy::start(
                kinference_gateway::tenancy::TenancyConfig {
                    per_tenant_spend: args.metrics_tenant_spend,
                    ..config.tenancy.clone()
                },
                &args.config,
                policy_files,
                config.model_names(),
                registry,
            )
        })
        .context("starting tenancy (API keys, limits, usage journal)")?;
    let _tenants_follow = cluster
        .as_ref()
        .map(|c| tenancy.follow(c.source.subscribe(), c.secrets.clone()));
    if let Some(c) = cluster.as_mut() {
        metrics.with_registry(|registry| c.source.register_metrics(registry));
    }
    let overload = metrics.with_registry(|registry| {
        kinference_gateway::overload::Overload::new(args.overload.clone(), registry)
    });
    let health = Arc::new(metrics.with_registry(|registry| {
        kinference_gateway::backend::health::Health::new(
            args.health.clone(),
            Arc::clone(&router),
            metrics.clone(),
            registry,
        )
    }));
    let gw = Arc::new(Gateway {
        router: Arc::clone(&router),
        // An answer past the limits counts against the worker's health.
        upstream: Upstream::new(&args.http)
            .with_headers(worker_headers)
            .with_health(health.clone()),
        metrics,
        settings: args.http.clone(),
        models: config.model_names(),
        messages_models: config.messages_models(),
        tenancy: Arc::clone(&tenancy),
        policy,
        pools,
        health,
        overload,
        access: kinference_gateway::access::Access::new(&args.access),
        draining: Default::default(),
        objectives: discovery
            .as_ref()
            .map(|d| d.objectives())
            .unwrap_or_default(),
    });

    // Pools with their own worker key or headers (InferencePool workerCredentials/workerHeaders).
    let _pool_headers = gw.pools.as_ref().map(|pools| {
        pools.spawn_worker_headers(
            gw.upstream.clone(),
            Arc::clone(&gw.router),
            gw.settings.health_interval(),
        )
    });

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let extproc = kinference_gateway::extproc::spawn(
        &args.extproc,
        &gw,
        &tls_metrics,
        stopped(stop_rx.clone()),
    )
    .await?;
    let api = server::bind(args.listen).await?;
    let admin = server::bind(args.admin_listen).await?;
    tracing::info!(listen = %args.listen, admin = %args.admin_listen, workers = config.workers.len(),
        routing = %config.routing, "kinference-gateway started");
    // One probe round before serving: no request (and no /readyz) sees an unprobed worker as healthy.
    let prober = gw.prober();
    prober.probe_all().await;
    // Which signals routing has per worker (also `kinference_gateway_routing_signal` and
    // `/healthz/workers`); agents that have not connected yet show as stale.
    for w in gw
        .metrics
        .refresh_fleet(&gw.router, &gw.pool_members())
        .await
        .workers
    {
        tracing::info!(worker = %w.view.url, model = %w.view.model,
            signals = %w.signals_json(), "routing signals");
    }
    let prober = tokio::spawn(prober.run());
    // The workers' LoRA adapters (their /v1/models), read before serving and every health interval.
    let adapters = kinference_gateway::backend::adapters::AdapterWatch {
        router: Arc::clone(&gw.router),
        upstream: gw.upstream.clone(),
        interval: gw.settings.health_interval(),
        timeout: gw.settings.health_timeout(),
    };
    adapters.learn_all().await;
    let adapters = tokio::spawn(adapters.run());
    let drain = Duration::from_secs(args.drain_timeout_seconds);
    let admin_task = tokio::spawn(server::serve(
        admin,
        Arc::clone(&gw),
        Port::Admin,
        stopped(stop_rx.clone()),
        drain,
    ));
    let api_task = tokio::spawn(server::serve(
        api,
        Arc::clone(&gw),
        Port::Api,
        stopped(stop_rx),
        drain,
    ));

    // The drain: not ready at once, still serving for the delay (while the endpoint is removed), then
    // the sockets close and what is in flight gets up to the drain timeout.
    shutdown_signal().await;
    gw.start_draining();
    let delay = Duration::from_secs(args.shutdown_delay_seconds);
    tracing::info!(
        ?delay,
        ?drain,
        "SIGTERM: not ready; closing the listeners after the delay"
    );
    tokio::time::sleep(delay).await;
    let _ = stop_tx.send(true);
    let tasks = async {
        let _ = api_task.await;
        let _ = admin_task.await;
        if let Some(extproc) = extproc {
            let _ = extproc.await;
        }
    };
    if tokio::time::timeout(drain + Duration::from_secs(1), tasks)
        .await
        .is_err()
    {
        tracing::warn!(?drain, "still draining after the timeout; exiting");
    }
    prober.abort();
    adapters.abort();
    tracing::info!("drained");
    // Every usage record of the requests that finished during the graceful stop is on disk.
    tenancy.flush().await;
    telemetry.shutdown();
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
