//! One tenant cannot learn another's prompts from the workers' prefix caches (issue 32): with real
//! processes on loopback (two `vllm-sim` workers publishing KV events to a `kinference-agent`, the
//! gateway routing on the agent's index, both front doors), a prompt one tenant sent is a cache hit
//! only for requests of its own cache scope:
//!
//! - within a tenant, hits and routing are those of an unsalted prompt;
//! - another tenant's probe of it reports 0 cached tokens and is routed as a cold prompt (no worker
//!   is credited any cached token for it), also when the probe carries the tenant's own salt as
//!   its `cache_salt` (forged with the gateway's key, which no client has);
//! - tenants of one group share, and so do tenants that share on purpose;
//! - through the ext_proc door the worker receives the same salt in the mutated body.
//!
//! It prints the figures `bench/results/cache-isolation.md` quotes.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use kinference_gateway::tenancy::isolation::{SaltKey, Scope};
use serde_json::{Value, json};
use testkit::{ChildGuard, free_port, tokenizer_dir};

mod support;

use support::envoy::Envoy;

const MODEL: &str = "qwen2-sim";
const KEY_SECRET: &str = "cache-isolation-test-key-0123456789abcdef";

/// (tenant, API key, `promptCache` lines of its spec).
const TENANTS: [(&str, &str, &str); 6] = [
    ("alice", "sk-iso-alice-0123456789abcdef", ""),
    ("bob", "sk-iso-bob-0123456789abcdef", ""),
    (
        "carol",
        "sk-iso-carol-0123456789abcdef",
        "  promptCache: {isolation: Group, group: team}\n",
    ),
    (
        "dave",
        "sk-iso-dave-0123456789abcdef",
        "  promptCache: {isolation: Group, group: team}\n",
    ),
    (
        "sam",
        "sk-iso-sam-0123456789abcdef",
        "  promptCache: {isolation: Shared}\n",
    ),
    (
        "sue",
        "sk-iso-sue-0123456789abcdef",
        "  promptCache: {isolation: Shared}\n",
    ),
];

fn key_of(tenant: &str) -> &'static str {
    TENANTS
        .iter()
        .find(|(t, _, _)| *t == tenant)
        .map(|(_, k, _)| *k)
        .expect("a tenant of the test")
}

/// A prompt of about 300 tokens, distinct per `topic`.
fn prompt(topic: &str) -> String {
    let mut text = format!("Confidential briefing on {topic}. ");
    for i in 0..40 {
        text.push_str(&format!("Clause {i} of the {topic} plan says nothing. "));
    }
    text
}

/// One answer: the worker that served it, the cached prompt tokens it reported, the
/// router's explanation.
#[derive(Debug)]
struct Served {
    worker: String,
    cached: u64,
    prompt_tokens: u64,
    decision: String,
}

impl Served {
    /// Every candidate the router credited with 0 cached tokens: routed as a cold prompt.
    fn routed_cold(&self) -> bool {
        let router = self.decision.split("router: ").nth(1).unwrap_or_default();
        !router.is_empty()
            && router
                .split("; ")
                .filter(|c| c.contains(" cached="))
                .all(|c| c.contains(" cached=0 "))
    }
}

fn served(head: &str, body: &str) -> Served {
    let header = |name: &str| {
        head.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .unwrap_or_default()
            .to_string()
    };
    let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
    Served {
        worker: header("x-kinference-worker"),
        cached: v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
        decision: header("x-kinference-decision"),
    }
}

/// A completion of `text` as `tenant` (with `salt` as the client's `cache_salt`) through the HTTP
/// door, explained (loopback callers are admins here).
async fn complete(api: u16, tenant: &str, text: &str, salt: Option<&str>) -> Served {
    let mut body = json!({"model": MODEL, "prompt": text, "max_tokens": 2});
    if let Some(s) = salt {
        body["cache_salt"] = json!(s);
    }
    let bearer = format!("Bearer {}", key_of(tenant));
    let (status, head, text) = support::call(
        "127.0.0.1",
        api,
        "POST",
        "/v1/completions",
        &[("authorization", &bearer), ("x-kinference-debug", "1")],
        &body.to_string(),
    )
    .await;
    assert_eq!(status, 200, "{tenant}: {text}");
    served(&head, &text)
}

/// `complete` until the agent's index has caught up with what `tenant` sent: the same request
/// again, served with cached tokens (each try is itself a request of the tenant's, so hits only
/// grow).
async fn settled(api: u16, tenant: &str, text: &str) -> Served {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let s = complete(api, tenant, text, None).await;
        if s.cached > 0 && !s.routed_cold() {
            return s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{tenant}'s own prompt never became a routed hit: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn write_config(dir: &Path, sims: &[u16], agent_grpc: u16) -> std::path::PathBuf {
    let mut yaml = Vec::new();
    for (tenant, key, extra) in TENANTS {
        let secrets = dir.join("secrets").join(tenant);
        std::fs::create_dir_all(&secrets).unwrap();
        std::fs::write(secrets.join("api-key"), key).unwrap();
        yaml.push(format!(
            "apiVersion: kinference.ai/v1alpha1\nkind: InferenceTenant\nmetadata: {{name: {tenant}}}\nspec:\n  apiKeys:\n    - secretRef: {{name: {tenant}, key: api-key}}\n{extra}"
        ));
    }
    std::fs::write(dir.join("tenants.yaml"), yaml.join("---\n")).unwrap();
    std::fs::write(dir.join("salt.key"), format!("{KEY_SECRET}\n")).unwrap();
    let workers: String = sims
        .iter()
        .map(|p| format!("  - {{url: \"http://127.0.0.1:{p}\", model: {MODEL}}}\n"))
        .collect();
    let config = dir.join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "models:\n  - {{name: {MODEL}, tokenizer_dir: \"{}\"}}\nworkers:\n{workers}agents: [\"http://127.0.0.1:{agent_grpc}\"]\nrouting: kinference\ntenancy:\n  tenants_dir: {}\n  secrets_dir: {}\n  usage_journal: {}\n  cache_salt_key_file: {}\n",
            tokenizer_dir().display(),
            dir.display(),
            dir.join("secrets").display(),
            dir.join("usage.jsonl").display(),
            dir.join("salt.key").display(),
        ),
    )
    .unwrap();
    config
}

/// What the figures need from the run.
struct Stack {
    api: u16,
    admin: u16,
    xp: u16,
    _children: Vec<ChildGuard>,
    _dir: support::TempDir,
}

async fn start() -> Option<Stack> {
    let sim = support::vllm_sim_binary()?;
    let agent_bin = support::agent_binary();
    let dir = support::TempDir::new("cache-isolation");
    let (agent_grpc, agent_metrics) = (free_port(), free_port());
    let ports: Vec<(u16, u16, u16)> = (0..2)
        .map(|_| (free_port(), free_port(), free_port()))
        .collect();
    // The agent binds the SUB sockets the workers connect to, as next to a vLLM pod.
    let workers_yaml: String = ports
        .iter()
        .enumerate()
        .map(|(i, (http, events, replay))| {
            format!(
                "  - {{url: \"http://127.0.0.1:{http}\", model: {MODEL}, kv_events_endpoint: \"tcp://127.0.0.1:{events}\", kv_events_bind: true, kv_replay_endpoint: \"tcp://127.0.0.1:{replay}\", kv_topic: \"kv@w{i}@{MODEL}\"}}\n"
            )
        })
        .collect();
    let agent_yaml = dir.0.join("agent-workers.yaml");
    std::fs::write(&agent_yaml, format!("workers:\n{workers_yaml}")).unwrap();
    let mut children = vec![ChildGuard(
        Command::new(&agent_bin)
            .args(["--grpc-listen", &format!("127.0.0.1:{agent_grpc}")])
            .args(["--metrics-listen", &format!("127.0.0.1:{agent_metrics}")])
            .arg("--workers")
            .arg(&agent_yaml)
            .args(["--node", "iso-node"])
            .env("KINFERENCE_DISABLE_EBPF", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting kinference-agent"),
    )];
    support::wait_until_ok(agent_metrics, "/metrics").await;
    for (i, (http, events, replay)) in ports.iter().enumerate() {
        children.push(ChildGuard(
            Command::new(&sim)
                .args(["--host", "127.0.0.1", "--port", &http.to_string()])
                .args([
                    "--model",
                    MODEL,
                    "--preset",
                    "fast",
                    "--seed",
                    &i.to_string(),
                ])
                .arg("--tokenizer-dir")
                .arg(tokenizer_dir())
                .args(["--kv-events-endpoint", &format!("tcp://127.0.0.1:{events}")])
                .args(["--kv-replay-endpoint", &format!("tcp://127.0.0.1:{replay}")])
                .args(["--kv-topic", &format!("kv@w{i}@{MODEL}")])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start vllm-sim"),
        ));
    }
    for (http, _, _) in &ports {
        support::wait_until_ok(*http, "/health").await;
    }
    let sims: Vec<u16> = ports.iter().map(|p| p.0).collect();
    let config = write_config(&dir.0, &sims, agent_grpc);
    let (api, admin, xp) = (free_port(), free_port(), free_port());
    let mut gateway = ChildGuard(
        support::gateway_command(&config, api, admin)
            .arg(format!("--extproc-listen=127.0.0.1:{xp}"))
            .spawn()
            .expect("starting kinference-gateway"),
    );
    support::wait_until_ready(&mut gateway, admin).await;
    support::wait_for("both workers healthy and the agent connected", || async {
        let text = support::metrics_text(admin).await;
        let sum = |name: &str| -> f64 {
            text.lines()
                .filter(|l| l.starts_with(name))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        sum("kinference_gateway_worker_healthy") >= 2.0
            && sum("kinference_routing_agent_connected") >= 1.0
    })
    .await;
    children.push(gateway);
    Some(Stack {
        api,
        admin,
        xp,
        _children: children,
        _dir: dir,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_cannot_learn_anothers_prompts() {
    let Some(stack) = start().await else {
        return;
    };
    let api = stack.api;
    let _ = stack.admin;

    // Within a tenant: a routed hit, as for any prompt.
    let secret = prompt("the merger");
    let first = complete(api, "alice", &secret, None).await;
    assert_eq!(first.cached, 0, "{first:?}");
    let own = settled(api, "alice", &secret).await;
    assert_eq!(
        own.worker, first.worker,
        "alice's prompt stays on its worker"
    );
    let block = 16;
    assert_eq!(
        own.cached,
        (own.prompt_tokens - 1) / block * block,
        "every full block of alice's own prompt is a hit"
    );

    // Bob probes it: nothing cached, routed as a cold prompt.
    let probe = complete(api, "bob", &secret, None).await;
    assert_eq!(
        probe.cached, 0,
        "bob sees none of alice's prompt: {probe:?}"
    );
    assert!(
        probe.routed_cold(),
        "bob is routed as for a cold prompt: {probe:?}"
    );

    // Bob sends alice's own salt (forged with the gateway's key, which no client has): still nothing.
    let alices = SaltKey::from_secret(KEY_SECRET.as_bytes())
        .worker_salt(Scope::Tenant("alice"), None)
        .expect("alice is salted");
    let secret2 = prompt("the layoffs");
    complete(api, "alice", &secret2, None).await;
    settled(api, "alice", &secret2).await;
    let forged = complete(api, "bob", &secret2, Some(&alices)).await;
    assert_eq!(
        forged.cached, 0,
        "a client's salt cannot reach another tenant: {forged:?}"
    );
    assert!(forged.routed_cold(), "{forged:?}");
    // A client's own salt splits its tenant's cache, and is a hit for itself.
    let split = complete(api, "alice", &secret2, Some("project-x")).await;
    assert_eq!(split.cached, 0, "{split:?}");
    let split_again = complete(api, "alice", &secret2, Some("project-x")).await;
    assert!(
        split_again.cached > 0 || split_again.worker != split.worker,
        "{split_again:?}"
    );

    // A group shares; so do tenants that share on purpose.
    let plan = prompt("the team roadmap");
    complete(api, "carol", &plan, None).await;
    let carols = settled(api, "carol", &plan).await;
    let daves = complete(api, "dave", &plan, None).await;
    assert_eq!(
        daves.cached, carols.cached,
        "dave shares carol's group: {daves:?}"
    );
    assert_eq!(daves.worker, carols.worker, "{daves:?}");
    let memo = prompt("the public memo");
    complete(api, "sam", &memo, None).await;
    let sams = settled(api, "sam", &memo).await;
    let sues = complete(api, "sue", &memo, None).await;
    assert_eq!(
        sues.cached, sams.cached,
        "sue shares on purpose, as sam: {sues:?}"
    );
    assert_eq!(sues.worker, sams.worker, "{sues:?}");
    let bob_on_memo = complete(api, "bob", &memo, None).await;
    assert_eq!(
        bob_on_memo.cached, 0,
        "an isolated tenant does not hit the shared cache"
    );

    // The ext_proc door: the same salt in the body the worker receives, the same isolation.
    let envoy = Envoy::connect(std::net::SocketAddr::from(([127, 0, 0, 1], stack.xp))).await;
    let door_secret = prompt("the acquisition through Envoy");
    let body = json!({"model": MODEL, "prompt": door_secret, "max_tokens": 2}).to_string();
    let via_envoy = |tenant: &'static str| {
        let mut envoy = envoy.clone();
        let body = body.clone();
        async move {
            let bearer = format!("Bearer {}", key_of(tenant));
            let a = envoy
                .request(
                    "POST",
                    "/v1/completions",
                    &[("authorization", bearer.as_str())],
                    body.as_bytes(),
                )
                .await;
            assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
            let sent: Value =
                serde_json::from_slice(a.sent_body.as_deref().unwrap_or_default()).unwrap();
            let answer: Value = serde_json::from_slice(&a.body).unwrap_or(Value::Null);
            (
                sent["cache_salt"].as_str().unwrap_or_default().to_string(),
                answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0),
            )
        }
    };
    let (alice_salt, _) = via_envoy("alice").await;
    assert_eq!(
        alice_salt, alices,
        "the worker is sent the tenant's salt through Envoy"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (_, cached) = via_envoy("alice").await;
        if cached > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "alice never hit through Envoy"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (bob_salt, bob_cached) = via_envoy("bob").await;
    assert_ne!(bob_salt, alices);
    assert_eq!(bob_salt.len(), 64, "{bob_salt}");
    assert_eq!(bob_cached, 0, "bob's probe through Envoy sees nothing");

    // The hit rate within a tenant is that of unsalted prompts: the same shuffled workload (4 long
    // prompts x 4 questions) from alice (salted) and from sam (shared: unsalted), each its own prompts.
    let hit_share = |tenant: &'static str| async move {
        let mut order: Vec<(usize, usize)> =
            (0..4).flat_map(|p| (0..4).map(move |q| (p, q))).collect();
        order.sort_by_key(|(p, q)| (q * 7 + p * 3) % 16);
        let (mut cached, mut total) = (0, 0);
        for (p, q) in order {
            let text = format!(
                "{} Question {q}?",
                prompt(&format!("workload {p} of {tenant}"))
            );
            let s = complete(api, tenant, &text, None).await;
            cached += s.cached;
            total += s.prompt_tokens;
            // Each answer's blocks reach the index before the next request, as in steady traffic.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        (cached, total)
    };
    let (alice_hits, alice_total) = hit_share("alice").await;
    let (sam_hits, sam_total) = hit_share("sam").await;
    let (a, s) = (
        alice_hits as f64 / alice_total as f64,
        sam_hits as f64 / sam_total as f64,
    );
    assert!(
        a > 0.5 && (a - s).abs() < 0.03,
        "salted hit share {a:.3} vs unsalted {s:.3}"
    );

    println!(
        "cache isolation (2 vllm-sim workers, block 16, one agent):\n\
         - hit share within a tenant, 16 requests (4 prompts x 4 questions): alice (salted) {alice_hits}/{alice_total} = {a:.3}, sam (unsalted) {sam_hits}/{sam_total} = {s:.3}\n\
         - alice, own prompt again: cached {} of {} prompt tokens, worker {}\n\
         - bob probing it: cached {}, routed cold: {}, worker {} ({} alice's)\n\
         - bob with alice's salt forged: cached {}, routed cold: {}\n\
         - dave (carol's group) probing carol's prompt: cached {} (carol {}), same worker: {}\n\
         - sue (shared) probing sam's prompt: cached {} (sam {}), same worker: {}\n\
         - bob probing the shared prompt: cached {}",
        own.cached,
        own.prompt_tokens,
        own.worker,
        probe.cached,
        probe.routed_cold(),
        probe.worker,
        if probe.worker == own.worker {
            "="
        } else {
            "!="
        },
        forged.cached,
        forged.routed_cold(),
        daves.cached,
        carols.cached,
        daves.worker == carols.worker,
        sues.cached,
        sams.cached,
        sues.worker == sams.worker,
        bob_on_memo.cached,
    );
}
