//! `kinfctl`: policy tooling; offline, except `status`, `diff` and `explain KIND/NAME` without a
//! directory, which read a cluster.
//!
//! - `kinfctl lint DIR`: schema and semantic checks of a directory of CRD-shaped YAML (unknown
//!   references, unreachable/shadowed/conflicting rules, PII rules that could fail open).
//! - `kinfctl test DIR --cases FILE`: evaluates sample requests and compares the decisions with
//!   the expected ones (for CI in a policy repository).
//! - `kinfctl explain DIR --request FILE [--state FILE]`: the decision for one request, rule by rule.
//! - `kinfctl explain KIND/NAME [DIR]`: one object's apply state (`Accepted`, `RolledBack`,
//!   `Rejected`, `Conflict`), generations and conditions: as a gateway would report them after
//!   loading DIR, or without DIR as the gateway wrote them in the cluster (`-n NS`, `--kubeconfig`).
//! - `kinfctl status [-n NS]...`: every object's generation, serving generation and conditions in
//!   the cluster (kubeconfig like `kubectl`: `--kubeconfig`, `$KUBECONFIG`, `~/.kube/config`).
//! - `kinfctl diff DIR -n NS`: what applying the directory would change in that namespace (exit 1
//!   when something would change).
//!
//! Every message names its file and line. Exit codes: 0 ok, 1 findings or failed cases,
//! 2 usage or I/O errors.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use kinference_crds::Complexity;
use kinference_gateway::config_source::{files, inspect};
use kinference_gateway::policy::classify::{request_facts, tags::TAGS_HEADER};
use kinference_gateway::policy::engine::{
    Backend, Outcome, PolicyDecision, PoolStates, RequestFacts, evaluate,
};
use kinference_gateway::policy::lint::{Severity, lint_dir};
use kinference_gateway::policy::model::{PolicySet, Spec};
use kinference_gateway::policy::source::load_dir;
use serde::Deserialize;

#[derive(Parser)]
#[command(
    name = "kinfctl",
    version,
    about = "Lint, test and explain Kinference policies; status and diff against a cluster"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check a policy directory; exit 1 when there are errors.
    Lint {
        /// Directory of CRD-shaped YAML (searched recursively).
        dir: PathBuf,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Run expected-decision cases against a policy directory; exit 1 when one fails.
    Test {
        dir: PathBuf,
        /// YAML file with `cases: [{name, request, state?, expect}]`.
        #[arg(long)]
        cases: PathBuf,
    },
    /// Explain the decision for one request (`DIR --request FILE`), or the apply state and
    /// conditions of one object (`KIND/NAME [DIR]`; without DIR, from the cluster).
    Explain {
        /// A policy directory (with `--request`), or `KIND/NAME` (e.g. `ipol/route`).
        target: String,
        /// With `KIND/NAME`: the directory to load the object from (default: the cluster).
        dir: Option<PathBuf>,
        /// YAML/JSON file: `{tenant?, headers?, body, tags?, complexity?, prompt_tokens?}`.
        #[arg(long)]
        request: Option<PathBuf>,
        /// YAML/JSON file with pool state: `{pools: {NAME: {queue_depth, kv_cache_usage, estimated_ttft_ms, cached_tokens, available}}}`.
        #[arg(long)]
        state: Option<PathBuf>,
        /// With `KIND/NAME` in the cluster: the namespace (default: every namespace).
        #[arg(short, long = "namespace")]
        namespace: Option<String>,
        /// Kubeconfig (default: $KUBECONFIG, ~/.kube/config, in-cluster).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Serving generation and conditions of every object in the cluster.
    Status {
        /// Namespaces (default: all).
        #[arg(short, long = "namespace")]
        namespaces: Vec<String>,
        /// Kubeconfig (default: $KUBECONFIG, ~/.kube/config, in-cluster).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// What applying DIR would change in a namespace of the cluster; exit 1 when anything would.
    Diff {
        dir: PathBuf,
        /// The namespace compared.
        #[arg(short, long = "namespace", default_value = "default")]
        namespace: String,
        /// Kubeconfig (default: $KUBECONFIG, ~/.kube/config, in-cluster).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Text,
    Json,
}

/// A usage or I/O error: exit code 2.
struct Fatal(String);

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Lint { dir, format } => lint(&dir, format),
        Command::Test { dir, cases } => test(&dir, &cases),
        Command::Explain {
            target,
            dir,
            request,
            state,
            namespace,
            kubeconfig,
            format,
        } => match (request, dir) {
            (Some(request), None) => {
                explain(Path::new(&target), &request, state.as_deref(), format)
            }
            (Some(_), Some(_)) => Err(Fatal(
                "explain DIR --request FILE takes one directory".into(),
            )),
            (None, Some(dir)) => explain_object_in_dir(&target, &dir, format),
            (None, None) => cluster::explain_object(
                &target,
                namespace.as_deref(),
                kubeconfig.as_deref(),
                format,
            ),
        },
        Command::Status {
            namespaces,
            kubeconfig,
            format,
        } => cluster::status(&namespaces, kubeconfig.as_deref(), format),
        Command::Diff {
            dir,
            namespace,
            kubeconfig,
            format,
        } => cluster::diff(&dir, &namespace, kubeconfig.as_deref(), format),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(Fatal(message)) => {
            eprintln!("kinfctl: {message}");
            ExitCode::from(2)
        }
    }
}

fn lint(dir: &Path, format: Format) -> Result<bool, Fatal> {
    let (set, findings) = lint_dir(dir).map_err(|e| Fatal(e.to_string()))?;
    let errors = findings
        .iter()
        .filter(|f| f.severity == Severity::Error)
        .count();
    match format {
        Format::Json => {
            let json = serde_json::to_string_pretty(&findings).map_err(|e| Fatal(e.to_string()))?;
            println!("{json}");
        }
        Format::Text => {
            for f in &findings {
                println!("{f}");
            }
            println!(
                "{}: {} models, {} pools, {} providers, {} tenants, {} policies; {errors} error(s), {} warning(s)",
                dir.display(),
                set.models.len(),
                set.pools.len(),
                set.providers.len(),
                set.tenants.len(),
                set.policies.len(),
                findings.len() - errors
            );
        }
    }
    Ok(errors == 0)
}

/// A sample request as written in request and case files.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestSpec {
    /// Authenticated tenant (absent: unknown API key).
    #[serde(default)]
    tenant: Option<String>,
    /// Request headers (only `x-kinference-tags` matters here).
    #[serde(default)]
    headers: BTreeMap<String, String>,
    /// The request body: OpenAI chat/completions or Anthropic messages.
    body: serde_json::Value,
    /// Extra tags, as an upstream classifier would add.
    #[serde(default)]
    tags: Vec<String>,
    /// Overrides the complexity classifier.
    #[serde(default)]
    complexity: Option<Complexity>,
    /// Overrides the prompt-length estimate.
    #[serde(default)]
    prompt_tokens: Option<u64>,
}

impl RequestSpec {
    fn facts(&self) -> Result<RequestFacts, String> {
        let header = self
            .headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(TAGS_HEADER))
            .map(|(_, v)| v.as_str());
        let (mut facts, _) = request_facts(
            &self.body,
            self.tenant.as_deref(),
            header,
            self.prompt_tokens,
        )
        .ok_or("request body has no \"model\"")?;
        facts
            .tags
            .extend(self.tags.iter().map(|t| t.to_ascii_lowercase()));
        if let Some(c) = self.complexity {
            facts.complexity = Some(c);
        }
        Ok(facts)
    }
}

fn read_yaml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, Fatal> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Fatal(format!("cannot read {}: {e}", path.display())))?;
    serde_yaml::from_str(&text).map_err(|e| Fatal(kinference_gateway::yaml::describe(path, 1, &e)))
}

/// Loads a directory for evaluation; objects that failed validation are reported and fail the
/// command (a decision against a partly applied set would mislead).
fn load(dir: &Path) -> Result<Option<PolicySet>, Fatal> {
    let loaded = load_dir(dir, None).map_err(|e| Fatal(e.to_string()))?;
    let mut ok = true;
    for p in &loaded.problems {
        println!("{p}");
        ok = false;
    }
    for p in &loaded.outcome.problems {
        println!("{p}");
        ok = false;
    }
    if !ok {
        println!(
            "{}: the policy set has errors (run `kinfctl lint`)",
            dir.display()
        );
        return Ok(None);
    }
    Ok(Some(loaded.outcome.set))
}

fn explain(
    dir: &Path,
    request: &Path,
    state: Option<&Path>,
    format: Format,
) -> Result<bool, Fatal> {
    let spec: RequestSpec = read_yaml(request)?;
    let state: PoolStates = match state {
        Some(p) => read_yaml(p)?,
        None => PoolStates::default(),
    };
    let facts = spec
        .facts()
        .map_err(|e| Fatal(format!("{}: {e}", request.display())))?;
    let Some(set) = load(dir)? else {
        return Ok(false);
    };
    let decision = evaluate(&set, &facts, &state);
    match format {
        Format::Json => {
            let json = serde_json::json!({"facts": facts, "decision": decision});
            println!(
                "{}",
                serde_json::to_string_pretty(&json).map_err(|e| Fatal(e.to_string()))?
            );
        }
        Format::Text => {
            println!(
                "request: tenant={} model={} tags={:?} complexity={:?}",
                facts.tenant.as_deref().unwrap_or("<unknown>"),
                facts.model,
                facts.tags,
                facts.complexity
            );
            print!("{}", decision.explain());
        }
    }
    Ok(true)
}

/// `KIND/NAME` -> (kind, name).
fn object_name(target: &str) -> Result<(&'static str, &str), Fatal> {
    let (kind, name) = target
        .split_once('/')
        .filter(|(_, n)| !n.is_empty())
        .ok_or_else(|| {
            Fatal(format!(
                "{target}: expected KIND/NAME (e.g. InferencePolicy/route or ipol/route), or DIR --request FILE"
            ))
        })?;
    let kind = inspect::kind_named(kind).ok_or_else(|| {
        Fatal(format!(
            "{kind}: not a Kinference kind (one of {})",
            kinference_crds::KINDS.join(", ")
        ))
    })?;
    Ok((kind, name))
}

/// Prints explanations; true when every object is accepted.
fn print_explanations(found: &[inspect::Explanation], format: Format) -> Result<bool, Fatal> {
    match format {
        Format::Json => println!(
            "{}",
            serde_json::to_string_pretty(found).map_err(|e| Fatal(e.to_string()))?
        ),
        Format::Text => {
            for e in found {
                print!("{e}");
            }
        }
    }
    Ok(found.iter().all(|e| e.state == "Accepted"))
}

/// `explain KIND/NAME DIR`: the object's state after loading DIR as the gateway's file mode does.
fn explain_object_in_dir(target: &str, dir: &Path, format: Format) -> Result<bool, Fatal> {
    let (kind, name) = object_name(target)?;
    let loaded = load_dir(dir, None).map_err(|e| Fatal(e.to_string()))?;
    let snapshot = files::snapshot(&loaded.outcome, 1);
    let found: Vec<_> = snapshot
        .objects
        .values()
        .filter(|e| e.object.kind == kind && e.object.name == name)
        .map(|e| {
            let mut explained = inspect::explain_entry(e);
            // What its flow-control fields do, as the set it serves holds it.
            let spec = match snapshot.set.manifest(&e.object.key()).map(|m| m.spec) {
                Some(Spec::Tenant(t)) => serde_json::to_value(t).ok(),
                Some(Spec::Pool(p)) => serde_json::to_value(p).ok(),
                _ => None,
            };
            if let Some(spec) = spec {
                explained.flow = inspect::flow_notes(kind, &spec);
            }
            explained
        })
        .collect();
    if found.is_empty() {
        for p in loaded.problems.iter().filter(|p| p.message.contains(name)) {
            eprintln!("{p}");
        }
        return Err(Fatal(format!(
            "{kind}/{name}: not found in {}",
            dir.display()
        )));
    }
    print_explanations(&found, format)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CasesFile {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    request: RequestSpec,
    #[serde(default)]
    state: PoolStates,
    expect: Expect,
}

/// Expected decision; only the given fields are compared.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Expect {
    /// `route`, `burst` or `reject`.
    outcome: String,
    /// `policy/rule`, or `default` for no deciding rule.
    #[serde(default)]
    rule: Option<String>,
    /// First target, `pool/NAME` or `provider/NAME`.
    #[serde(default)]
    target: Option<String>,
    /// Model sent upstream by the first target.
    #[serde(default)]
    model: Option<String>,
    /// Reject status.
    #[serde(default)]
    status: Option<u16>,
    /// Reject code.
    #[serde(default)]
    code: Option<String>,
    /// Whether the request was local-only.
    #[serde(default)]
    local_only: Option<bool>,
    /// No target may be remote.
    #[serde(default)]
    all_local: Option<bool>,
}

fn check(expect: &Expect, d: &PolicyDecision) -> Vec<String> {
    let mut diffs = Vec::new();
    let (outcome, first) = match &d.outcome {
        Outcome::Route(p) => (if p.burst { "burst" } else { "route" }, p.targets.first()),
        Outcome::Reject(_) => ("reject", None),
    };
    if expect.outcome != outcome {
        diffs.push(format!(
            "outcome: expected {}, got {outcome}",
            expect.outcome
        ));
    }
    if let Some(rule) = &expect.rule {
        let got = d.rule().map_or("default".to_string(), ToString::to_string);
        if *rule != got {
            diffs.push(format!("rule: expected {rule}, got {got}"));
        }
    }
    if let Some(target) = &expect.target {
        let got = first.map_or("<none>".to_string(), |t| t.backend.to_string());
        if *target != got {
            diffs.push(format!("target: expected {target}, got {got}"));
        }
    }
    if let Some(model) = &expect.model {
        let got = first.map_or("<none>", |t| t.model.as_str());
        if model != got {
            diffs.push(format!("model: expected {model}, got {got}"));
        }
    }
    if let Outcome::Reject(r) = &d.outcome {
        if let Some(status) = expect.status
            && status != r.status
        {
            diffs.push(format!("status: expected {status}, got {}", r.status));
        }
        if let Some(code) = &expect.code
            && code != r.code
        {
            diffs.push(format!("code: expected {code}, got {}", r.code));
        }
    } else if expect.status.is_some() || expect.code.is_some() {
        diffs.push("status/code: expected a rejection".into());
    }
    if let Some(local) = expect.local_only
        && local != d.local_only.is_some()
    {
        diffs.push(format!(
            "localOnly: expected {local}, got {}",
            d.local_only.is_some()
        ));
    }
    if expect.all_local == Some(true)
        && let Outcome::Route(p) = &d.outcome
        && let Some(t) = p.targets.iter().find(|t| {
            matches!(t.backend, Backend::Provider(_))
                || t.locality != kinference_crds::Locality::Local
        })
    {
        diffs.push(format!("allLocal: {} is remote", t.backend));
    }
    diffs
}

fn case_line(text: &str, name: &str) -> usize {
    text.lines()
        .position(|l| {
            l.trim_start()
                .trim_start_matches("- ")
                .strip_prefix("name:")
                .is_some_and(|v| v.trim().trim_matches(|c| c == '"' || c == '\'') == name)
        })
        .map_or(1, |i| i + 1)
}

fn test(dir: &Path, cases_path: &Path) -> Result<bool, Fatal> {
    let cases: CasesFile = read_yaml(cases_path)?;
    let text = std::fs::read_to_string(cases_path).map_err(|e| Fatal(e.to_string()))?;
    let Some(set) = load(dir)? else {
        return Ok(false);
    };
    let (mut passed, mut failed) = (0, 0);
    for case in &cases.cases {
        let line = case_line(&text, &case.name);
        let facts = match case.request.facts() {
            Ok(f) => f,
            Err(e) => {
                println!("FAIL {}:{line}: {}: {e}", cases_path.display(), case.name);
                failed += 1;
                continue;
            }
        };
        let decision = evaluate(&set, &facts, &case.state);
        let diffs = check(&case.expect, &decision);
        if diffs.is_empty() {
            println!("PASS {}", case.name);
            passed += 1;
        } else {
            failed += 1;
            println!(
                "FAIL {}:{line}: {}: {}",
                cases_path.display(),
                case.name,
                diffs.join("; ")
            );
            for l in decision.explain().lines() {
                println!("    {l}");
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    Ok(failed == 0)
}

/// `status` and `diff`: the subcommands that read a cluster.
mod cluster {
    use std::path::Path;

    use kinference_gateway::config_source::inspect::{self, Change};
    use kinference_gateway::config_source::kube::client;

    use super::{Fatal, Format, load_dir, object_name, print_explanations};

    fn runtime() -> Result<tokio::runtime::Runtime, Fatal> {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Fatal(format!("tokio: {e}")))
    }

    pub fn status(
        namespaces: &[String],
        kubeconfig: Option<&Path>,
        format: Format,
    ) -> Result<bool, Fatal> {
        let objects = runtime()?.block_on(async {
            let client = client(kubeconfig).await.map_err(|e| Fatal(e.to_string()))?;
            inspect::live_objects(&client, namespaces)
                .await
                .map_err(|e| Fatal(format!("listing the objects: {e}")))
        })?;
        let rows: Vec<_> = objects
            .iter()
            .map(|(o, v)| inspect::status_row(o, v))
            .collect();
        let mut healthy = true;
        if let Format::Json = format {
            println!(
                "{}",
                serde_json::to_string_pretty(&rows).map_err(|e| Fatal(e.to_string()))?
            );
        }
        let opt = |g: Option<i64>| g.map_or("-".to_string(), |g| g.to_string());
        for r in &rows {
            let cond = |t: &str| r.conditions.get(t).map_or("-", |c| c.0.as_str());
            let rolled_back = cond("RolledBack") == "True";
            healthy &= cond("Accepted") == "True" && !rolled_back;
            if let Format::Text = format {
                println!(
                    "{:<18} {:<12} {:<24} gen {:<3} observed {:<3} serving {:<3} Accepted={} Ready={} RolledBack={} state={}",
                    r.object.kind,
                    r.object.namespace,
                    r.object.name,
                    opt(r.generation),
                    opt(r.observed_generation),
                    opt(r.active_generation),
                    cond("Accepted"),
                    cond("Ready"),
                    cond("RolledBack"),
                    r.state,
                );
                if let Some((_, message)) = r
                    .conditions
                    .get("RolledBack")
                    .filter(|_| rolled_back)
                    .or_else(|| r.conditions.get("Accepted").filter(|c| c.0 != "True"))
                {
                    println!("    {message}");
                }
            }
        }
        Ok(healthy)
    }

    /// `explain KIND/NAME`: the object's status as the gateway wrote it in the cluster.
    pub fn explain_object(
        target: &str,
        namespace: Option<&str>,
        kubeconfig: Option<&Path>,
        format: Format,
    ) -> Result<bool, Fatal> {
        let (kind, name) = object_name(target)?;
        let namespaces: Vec<String> = namespace.map(str::to_string).into_iter().collect();
        let objects = runtime()?.block_on(async {
            let client = client(kubeconfig).await.map_err(|e| Fatal(e.to_string()))?;
            inspect::live_objects(&client, &namespaces)
                .await
                .map_err(|e| Fatal(format!("listing the objects: {e}")))
        })?;
        let found: Vec<_> = objects
            .iter()
            .filter(|(o, _)| o.kind == kind && o.name == name)
            .map(|(o, v)| inspect::explain_live(o, v))
            .collect();
        if found.is_empty() {
            return Err(Fatal(format!("{kind}/{name}: not found in the cluster")));
        }
        print_explanations(&found, format)
    }

    pub fn diff(
        dir: &Path,
        namespace: &str,
        kubeconfig: Option<&Path>,
        format: Format,
    ) -> Result<bool, Fatal> {
        let loaded = load_dir(dir, None).map_err(|e| Fatal(e.to_string()))?;
        for p in &loaded.problems {
            eprintln!("{p}");
        }
        for p in &loaded.outcome.problems {
            eprintln!("{p}");
        }
        let local: Vec<_> = loaded
            .outcome
            .states
            .keys()
            .filter_map(|k| loaded.outcome.set.manifest(k))
            .collect();
        let live = runtime()?.block_on(async {
            let client = client(kubeconfig).await.map_err(|e| Fatal(e.to_string()))?;
            inspect::live_objects(&client, &[namespace.to_string()])
                .await
                .map_err(|e| Fatal(format!("listing the objects: {e}")))
        })?;
        let changes = inspect::diff(&local, &live);
        match format {
            Format::Json => println!(
                "{}",
                serde_json::to_string_pretty(&changes).map_err(|e| Fatal(e.to_string()))?
            ),
            Format::Text => {
                for c in &changes {
                    match c {
                        Change::Create { object } => println!("+ {object} (created)"),
                        Change::Update { object, paths } => {
                            println!("~ {object}");
                            for p in paths {
                                println!("    {p}");
                            }
                        }
                        Change::Delete { object } => {
                            println!("- {object} (in the cluster, not in {})", dir.display())
                        }
                    }
                }
                if changes.is_empty() {
                    println!("no changes");
                }
            }
        }
        Ok(changes.is_empty() && loaded.outcome.problems.is_empty())
    }
}
