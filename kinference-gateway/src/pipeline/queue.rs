//! Stage "queue": admission to a pool, then flow control, between the plan and the forward stage.
//!
//! - The request's band is its tenant's priority; `x-kinference-priority`, and the standard
//!   `InferenceObjective` named in `x-gateway-inference-objective` ([`crate::discovery::objectives`]),
//!   may lower it, and raise it only where the tenant's `flowControl.requestPriority` allows (both
//!   named: the lower of the two). The band is also what a worker with priority scheduling is sent
//!   ([`crate::pipeline::forward`]).
//! - A request naming a time-to-first-token objective (`x-kinference-ttft-objective-ms`, where its
//!   tenant's `flowControl.objectives` allows it, no tighter than its `minTtftMs`) goes to the workers
//!   of its pool estimated to meet it; when none is, its tenant's `onMiss` says what happens: the
//!   plan's next pool estimated to meet it or its next provider (`Fallback`), a refusal at once (503
//!   `objective_unmet` with `Retry-After`, `Refuse`), or the fastest worker anyway (`Serve`). The
//!   estimate is that of a short uncached request sent now ([`WorkerPressure::est_ttft_s`]): the
//!   request's own is no shorter, so a refusal is never for a worker that could have met it. A
//!   time-per-output-token objective (`x-kinference-tpot-objective-ms`, no tighter than `minTpotMs`)
//!   is met by a worker whose recent time per output token (learned from its streams,
//!   [`WorkerPressure::tpot_s`]) is within it; a worker that has streamed nothing yet has no figure
//!   to refuse it by and counts as meeting it. With both objectives, a worker must meet both.
//! - While the plan's first pool is saturated the request waits here, in its band, fair between
//!   tenants by tokens, and is then routed with the workers' state of the moment it leaves the
//!   queue; one that waits too long is shed with 429/503 and `Retry-After` in the client's protocol
//!   and settled like any refusal ([`crate::overload::flow`]). While it waits, a later pool of a
//!   plan a policy rule chose (its `route` targets, in the rule's order) that has room takes it
//!   instead: it leaves the queue and goes on to that pool (the explanation says after how long).
//!   The default route's later pools are failover only, and providers are never moved to this way
//!   (they cost money; bursting is the policy's call). Both front doors run it, for every endpoint a
//!   worker answers.

use std::sync::Arc;

use kinference_crds::{ObjectiveMiss, TenantObjectives, TenantPriority};
use tracing::Instrument as _;

use super::exchange::{Door, Exchange, Request};
use crate::errors::GatewayError;
use crate::gateway::Gateway;
use crate::overload::flow::{Probe, ShedReason, Ticket};
use crate::policy::stage::{Plan, PlanTarget};
use crate::routing::pools::WorkerPressure;

/// Stage "queue" for `request` under `plan`: the plan it is forwarded by (its objective may move
/// it), once its pool has room. At once when the endpoint has no worker, flow control is off, or the
/// plan starts with a provider.
pub async fn queue(
    gw: &Gateway,
    ex: &mut Exchange,
    request: &Request,
    plan: Arc<Plan>,
) -> Result<Arc<Plan>, GatewayError> {
    let band = request_band(gw, ex);
    ex.band = Some(band);
    if !ex.endpoint.reaches_backend() {
        return Ok(plan);
    }
    let mut plan = meet_objective(gw, ex, request, band, plan)?;
    let flow = &gw.overload.flow;
    if !flow.enabled() {
        return Ok(plan);
    }
    let ticket = ticket(ex, request, band);
    let since = std::time::Instant::now();
    let (waited, key) = loop {
        let Some(PlanTarget::Pool {
            pool,
            model,
            workers,
        }) = plan.targets.first()
        else {
            return Ok(plan);
        };
        let key = format!("{pool}/{model}");
        let wait = flow
            .wait(&key, probe(gw, model, workers.as_deref()), ticket.clone())
            .instrument(tracing::debug_span!("queue"));
        tokio::select! {
            biased;
            waited = wait => break (waited, key.clone()),
            later = later_pool_with_room(gw, &plan) => {
                let target = plan.targets[later].clone();
                tracing::debug!(from = %key, to = ?target, "a later pool of the plan has room: the request moves on");
                if ex.debug {
                    let before = ex.explain.take().unwrap_or_default();
                    ex.explain = Some(format!(
                        "{before}; queue: pool {key} saturated, moved to the plan's target {later} after {} ms",
                        since.elapsed().as_millis()
                    ));
                }
                plan = replan(&plan, later, target, false);
            }
        }
    };
    match waited {
        Ok(passed) => {
            if ex.debug
                && let Some(line) = &passed.explain
            {
                let before = ex.explain.take().unwrap_or_default();
                ex.explain = Some(format!(
                    "{before}; {line} after {} ms",
                    passed.waited.as_millis()
                ));
            }
            if let Some(s) = ex.settlement() {
                s.hold_flow(passed);
            }
            Ok(plan)
        }
        Err(shed) => {
            tracing::debug!(pool = %key, reason = shed.reason.as_str(), waited_ms = shed.waited.as_millis() as u64, "request shed by flow control");
            Err(shed.into())
        }
    }
}

/// What the flow control reads `model`'s pool (its workers `within`) through.
fn probe(gw: &Gateway, model: &str, within: Option<&[String]>) -> Probe {
    let router = Arc::clone(&gw.router);
    let (served, within) = (model.to_string(), within.map(<[String]>::to_vec));
    Arc::new(move || router.pressure(&served, within.as_deref()))
}

/// How often a waiting request looks at its plan's later pools: each look reads every worker of
/// them, for every waiting request, so less often than the dispatcher judges its own pool.
const LATER_POOL_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Resolves, once a later pool of `plan` than its first has room (judged every
/// [`LATER_POOL_EVERY`]), to that target's index; never for a plan with no later pool, nor for
/// one no policy rule chose.
async fn later_pool_with_room(gw: &Gateway, plan: &Plan) -> usize {
    if !plan.chosen_by_a_rule() || !has_later_pool(&plan.targets) {
        return std::future::pending().await;
    }
    let flow = &gw.overload.flow;
    loop {
        tokio::time::sleep(LATER_POOL_EVERY).await;
        let judged = first_later_with_room(&plan.targets, |model, workers| {
            let verdict = flow.judge(&probe(gw, model, workers));
            verdict.workers > 0 && !verdict.saturated
        });
        if let Some(i) = judged {
            return i;
        }
    }
}

/// Whether `targets` has a pool after its first target.
fn has_later_pool(targets: &[PlanTarget]) -> bool {
    targets
        .iter()
        .skip(1)
        .any(|t| matches!(t, PlanTarget::Pool { .. }))
}

/// The first pool after the first target that `has_room` (asked with its model and workers), by
/// index in `targets`; providers are passed over.
fn first_later_with_room(
    targets: &[PlanTarget],
    has_room: impl Fn(&str, Option<&[String]>) -> bool,
) -> Option<usize> {
    targets
        .iter()
        .enumerate()
        .skip(1)
        .find_map(|(i, t)| match t {
            PlanTarget::Pool { model, workers, .. } if has_room(model, workers.as_deref()) => {
                Some(i)
            }
            _ => None,
        })
}

/// The band of the request: its tenant's priority, and what its headers may claim of it.
fn request_band(gw: &Gateway, ex: &Exchange) -> TenantPriority {
    let own = ex.caller.as_ref().map(|c| c.priority()).unwrap_or_default();
    let may_raise = ex
        .caller
        .as_ref()
        .and_then(|c| c.tenant())
        .and_then(|t| t.flow_control.as_ref())
        .is_some_and(|f| f.request_priority);
    let objective = ex.objective.as_deref().and_then(|o| gw.objectives.band(o));
    band(own, lower(ex.asked_band, objective), may_raise)
}

/// The lower of two claimed bands (either may be absent).
fn lower(a: Option<TenantPriority>, b: Option<TenantPriority>) -> Option<TenantPriority> {
    match (a, b) {
        (Some(a), Some(b)) => Some(if a.above(b) { b } else { a }),
        (a, b) => a.or(b),
    }
}

/// The time-to-first-token objective, in seconds, a request naming `asked_ms` holds its tenant's
/// `rule` to: never tighter than the rule's `minTtftMs`.
pub fn ttft_objective_s(asked_ms: u32, rule: &TenantObjectives) -> f64 {
    f64::from(asked_ms.max(rule.min_ttft_ms.unwrap_or(1))) / 1000.0
}

/// The time-per-output-token objective, in seconds, a request naming `asked_ms` holds its tenant's
/// `rule` to: never tighter than the rule's `minTpotMs`.
pub fn tpot_objective_s(asked_ms: u32, rule: &TenantObjectives) -> f64 {
    f64::from(asked_ms.max(rule.min_tpot_ms.unwrap_or(1))) / 1000.0
}

/// A request's latency objectives, seconds (either may be absent).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Objectives {
    /// Time to first token.
    pub ttft_s: Option<f64>,
    /// Time per output token.
    pub tpot_s: Option<f64>,
}

impl Objectives {
    /// Whether `worker` is estimated to meet both (a worker with no TPOT figure yet meets that one).
    fn met_by(&self, worker: &WorkerPressure) -> bool {
        self.ttft_s.is_none_or(|o| worker.est_ttft_s <= o)
            && self
                .tpot_s
                .is_none_or(|o| worker.tpot_s.is_none_or(|t| t <= o))
    }

    /// The objectives, as the explanation shows them.
    fn describe(&self) -> String {
        let ms = |s: f64| s * 1000.0;
        match (self.ttft_s, self.tpot_s) {
            (Some(t), Some(p)) => format!("ttft <= {:.0} ms, tpot <= {:.0} ms", ms(t), ms(p)),
            (Some(t), None) => format!("ttft <= {:.0} ms", ms(t)),
            (None, Some(p)) => format!("tpot <= {:.0} ms", ms(p)),
            (None, None) => "none".to_string(),
        }
    }
}

/// The workers of `pressure` estimated to meet `objectives`.
pub fn meeting(pressure: &[WorkerPressure], objectives: &Objectives) -> Vec<String> {
    pressure
        .iter()
        .filter(|p| objectives.met_by(p))
        .map(|p| p.worker.clone())
        .collect()
}

/// The plan for a request with a latency objective: its first pool narrowed to the workers estimated
/// to meet it, or (none does) what its tenant's `onMiss` says. Unchanged without an objective, or
/// where the tenant allows none.
fn meet_objective(
    gw: &Gateway,
    ex: &mut Exchange,
    request: &Request,
    band: TenantPriority,
    plan: Arc<Plan>,
) -> Result<Arc<Plan>, GatewayError> {
    let tenant = ex.caller.as_ref().and_then(|c| c.tenant());
    let rule = tenant
        .and_then(|t| t.flow_control.as_ref())
        .and_then(|f| f.objectives.clone());
    let tenant = tenant.map_or_else(|| "anonymous".to_string(), |t| t.label.clone());
    let Some(rule) = rule else {
        return Ok(plan);
    };
    let objectives = Objectives {
        ttft_s: ex.objectives.ttft_ms.map(|ms| ttft_objective_s(ms, &rule)),
        tpot_s: ex.objectives.tpot_ms.map(|ms| tpot_objective_s(ms, &rule)),
    };
    if objectives == Objectives::default() {
        return Ok(plan);
    }
    // Providers: a later target a request may burst to (Envoy forwards to workers only).
    let providers =
        request.provider_request().is_some() && !plan.local_only && ex.door == Door::Http;
    let mut notes = Vec::new();
    let pressure = |model: &str, workers: Option<&[String]>| gw.router.pressure(model, workers);
    let choice = choose(
        &plan.targets,
        pressure,
        &objectives,
        rule.on_miss,
        providers,
        &mut notes,
    );
    explain(ex, &objectives, &notes);
    let (from, target) = match choice {
        Choice::Keep => return Ok(plan),
        Choice::Target(from, target) => (from, target),
        Choice::Refuse => {
            let ticket = Ticket {
                band,
                tenant,
                weight: 1,
                cost: 0,
                deadline: None,
            };
            tracing::debug!(
                objectives = objectives.describe(),
                "no worker estimated to meet the request's objectives; refused"
            );
            return Err(gw
                .overload
                .flow
                .refuse(&ticket, ShedReason::ObjectiveUnmet)
                .into());
        }
    };
    let burst = matches!(target, PlanTarget::Provider { .. });
    Ok(replan(&plan, from, target, burst))
}

/// Where a request with latency objectives goes among a plan's `targets`.
#[derive(Debug, PartialEq)]
pub enum Choice {
    /// The plan as it is (a provider first, or `onMiss: Serve`).
    Keep,
    /// From target `.0` on, that target replaced by `.1` (a pool narrowed to the workers that meet
    /// the objective, or the provider it bursts to).
    Target(usize, PlanTarget),
    /// Refused: nothing it may go to is estimated to meet it.
    Refuse,
}

/// The [`Choice`] for `targets`, each pool's workers read through `pressure`, on a miss of the first
/// pool what `on_miss` says (`providers`: a later provider may take the request); `notes` say what
/// each target offered.
pub fn choose(
    targets: &[PlanTarget],
    pressure: impl Fn(&str, Option<&[String]>) -> Vec<WorkerPressure>,
    objectives: &Objectives,
    on_miss: ObjectiveMiss,
    providers: bool,
    notes: &mut Vec<String>,
) -> Choice {
    for (i, target) in targets.iter().enumerate() {
        let first = i == 0;
        match target {
            PlanTarget::Pool {
                pool,
                model,
                workers,
            } => {
                let pressure = pressure(model, workers.as_deref());
                let meet = meeting(&pressure, objectives);
                notes.push(format!("{}/{} of pool {pool}", meet.len(), pressure.len()));
                if !meet.is_empty() && (first || on_miss == ObjectiveMiss::Fallback) {
                    let narrowed = PlanTarget::Pool {
                        pool: pool.clone(),
                        model: model.clone(),
                        workers: Some(meet),
                    };
                    return Choice::Target(i, narrowed);
                }
                if first {
                    match on_miss {
                        ObjectiveMiss::Serve => return Choice::Keep,
                        ObjectiveMiss::Refuse => return Choice::Refuse,
                        ObjectiveMiss::Fallback => {}
                    }
                }
            }
            // Nothing to estimate: a plan that starts with a provider keeps it.
            PlanTarget::Provider { .. } if first => return Choice::Keep,
            PlanTarget::Provider { provider, .. } if providers => {
                notes.push(format!("provider {provider}"));
                return Choice::Target(i, target.clone());
            }
            PlanTarget::Provider { .. } => {}
        }
    }
    Choice::Refuse
}

/// `plan` from target `from` on, that target replaced by `target`; `burst` when a provider takes
/// it for the pools.
fn replan(plan: &Plan, from: usize, target: PlanTarget, burst: bool) -> Arc<Plan> {
    let mut targets = vec![target];
    targets.extend(plan.targets.iter().skip(from + 1).cloned());
    Arc::new(Plan {
        targets,
        burst: plan.burst || burst,
        local_only: plan.local_only,
        rule: plan.rule.clone(),
        set: plan.set.clone(),
        explain: plan.explain.clone(),
    })
}

fn explain(ex: &mut Exchange, objectives: &Objectives, notes: &[String]) {
    if ex.debug {
        let before = ex.explain.take().unwrap_or_default();
        ex.explain = Some(format!(
            "{before}; objective: {} met by {}",
            objectives.describe(),
            notes.join(", ")
        ));
    }
}

/// The band of a request from a tenant of priority `own` that asked for `asked`: a lower band
/// always, a higher one only where the tenant `may_raise`.
pub fn band(own: TenantPriority, asked: Option<TenantPriority>, may_raise: bool) -> TenantPriority {
    match asked {
        Some(asked) if !asked.above(own) || may_raise => asked,
        _ => own,
    }
}

/// What the flow control weighs the request by: its band, tenant, weight and tokens.
fn ticket(ex: &Exchange, request: &Request, band: TenantPriority) -> Ticket {
    let tenant = ex.caller.as_ref().and_then(|c| c.tenant());
    let share = tenant
        .and_then(|t| t.flow_control.clone())
        .unwrap_or_default();
    let prompt = ex.tokens.size(request.prompt());
    let output = request.output_limit(ex.endpoint).unwrap_or(0);
    Ticket {
        band,
        tenant: tenant.map_or_else(|| "anonymous".to_string(), |t| t.label.clone()),
        weight: share.weight,
        cost: prompt.saturating_add(output),
        deadline: share
            .queue_deadline_ms
            .map(|ms| std::time::Duration::from_millis(u64::from(ms))),
    }
}

#[cfg(test)]
mod tests {
    use super::super::exchange::{PRIORITY_HEADER, asked_band};
    use super::*;
    use TenantPriority::{High, Low, Medium};
    use http::HeaderMap;

    #[test]
    fn a_request_may_lower_its_band_and_raise_it_only_where_its_tenant_allows() {
        assert_eq!(band(Medium, None, false), Medium);
        assert_eq!(band(Medium, Some(Low), false), Low);
        assert_eq!(band(Medium, Some(High), false), Medium);
        assert_eq!(band(Medium, Some(High), true), High);
        let mut headers = HeaderMap::new();
        headers.insert(PRIORITY_HEADER, http::HeaderValue::from_static(" HIGH "));
        assert_eq!(asked_band(&headers), Some(High));
        headers.insert(PRIORITY_HEADER, http::HeaderValue::from_static("urgent"));
        assert_eq!(asked_band(&headers), None);
        // Both a header and an objective: the lower claim.
        assert_eq!(lower(Some(High), Some(Low)), Some(Low));
        assert_eq!(lower(None, Some(High)), Some(High));
        assert_eq!(lower(Some(Medium), None), Some(Medium));
    }

    fn at(worker: &str, est_ttft_s: f64) -> WorkerPressure {
        WorkerPressure {
            worker: worker.into(),
            in_flight: 0,
            before_first_token: 0,
            signal: "ledger",
            engine_waiting: None,
            kv_usage: None,
            accept_backlog: None,
            kernel_ttfb: None,
            est_ttft_s,
            tpot_s: None,
        }
    }

    fn ttft(s: f64) -> Objectives {
        Objectives {
            ttft_s: Some(s),
            tpot_s: None,
        }
    }

    #[test]
    fn an_objective_is_met_by_the_workers_estimated_within_it_and_no_tighter_than_the_tenant_allows()
     {
        let rule = TenantObjectives {
            min_ttft_ms: Some(200),
            ..Default::default()
        };
        assert_eq!(ttft_objective_s(50, &rule), 0.2);
        assert_eq!(ttft_objective_s(1500, &rule), 1.5);
        let pressure = [at("a", 0.1), at("b", 0.25), at("c", 2.0)];
        assert_eq!(meeting(&pressure, &ttft(0.2)), ["a"]);
        assert_eq!(meeting(&pressure, &ttft(1.5)), ["a", "b"]);
        assert!(meeting(&pressure, &ttft(0.05)).is_empty());
    }

    #[test]
    fn a_tpot_objective_is_met_by_the_workers_decoding_within_it_or_not_yet_measured() {
        let rule = TenantObjectives {
            min_tpot_ms: Some(20),
            ..Default::default()
        };
        assert_eq!(tpot_objective_s(5, &rule), 0.02);
        assert_eq!(tpot_objective_s(50, &rule), 0.05);
        let decoding = |worker, est_ttft_s, tpot_s| WorkerPressure {
            tpot_s,
            ..at(worker, est_ttft_s)
        };
        let pressure = [
            decoding("fast", 1.0, Some(0.015)),
            decoding("slow", 0.1, Some(0.080)),
            decoding("new", 0.5, None),
        ];
        let tpot = |s| Objectives {
            ttft_s: None,
            tpot_s: Some(s),
        };
        assert_eq!(meeting(&pressure, &tpot(0.05)), ["fast", "new"]);
        assert_eq!(meeting(&pressure, &tpot(0.01)), ["new"]);
        // Both objectives: a worker must meet both.
        let both = Objectives {
            ttft_s: Some(0.6),
            tpot_s: Some(0.05),
        };
        assert_eq!(meeting(&pressure, &both), ["new"]);
        assert_eq!(both.describe(), "ttft <= 600 ms, tpot <= 50 ms");
    }

    fn pool(name: &str) -> PlanTarget {
        PlanTarget::Pool {
            pool: name.into(),
            model: format!("model-{name}"),
            workers: None,
        }
    }

    fn provider() -> PlanTarget {
        PlanTarget::Provider {
            provider: "cloud".into(),
            model: "cloud-mini".into(),
        }
    }

    /// Pool `a`'s workers are estimated at 2 s and 3 s, pool `b`'s at 0.1 s and 1 s.
    fn pressure(model: &str, _: Option<&[String]>) -> Vec<WorkerPressure> {
        match model {
            "model-a" => vec![at("a1", 2.0), at("a2", 3.0)],
            "model-b" => vec![at("b1", 0.1), at("b2", 1.0)],
            _ => Vec::new(),
        }
    }

    fn narrowed(name: &str, workers: &[&str]) -> PlanTarget {
        PlanTarget::Pool {
            pool: name.into(),
            model: format!("model-{name}"),
            workers: Some(workers.iter().map(|w| w.to_string()).collect()),
        }
    }

    #[test]
    fn a_waiting_request_moves_on_to_the_first_later_pool_with_room_never_to_a_provider() {
        let plan = [pool("a"), provider(), pool("b"), pool("c")];
        let room_in = |models: &'static [&'static str]| {
            move |model: &str, _: Option<&[String]>| models.contains(&model)
        };
        assert_eq!(
            first_later_with_room(&plan, room_in(&["model-b", "model-c"])),
            Some(2)
        );
        assert_eq!(first_later_with_room(&plan, room_in(&["model-c"])), Some(3));
        // The first pool is where it waits already; no later pool with room: it stays.
        assert_eq!(first_later_with_room(&plan, room_in(&["model-a"])), None);
        assert!(has_later_pool(&plan));
        assert!(!has_later_pool(&[pool("a"), provider()]));
    }

    #[test]
    fn a_missed_objective_falls_back_refuses_or_serves_as_the_tenant_says() {
        use ObjectiveMiss::{Fallback, Refuse, Serve};
        let choose = |targets: &[PlanTarget], objective_s, miss, providers| {
            choose(
                targets,
                pressure,
                &ttft(objective_s),
                miss,
                providers,
                &mut Vec::new(),
            )
        };
        let plan = [pool("a"), pool("b"), provider()];
        // Met by the first pool: narrowed to the workers that meet it, whatever onMiss says.
        for miss in [Fallback, Refuse, Serve] {
            assert_eq!(
                choose(&plan, 2.5, miss, true),
                Choice::Target(0, narrowed("a", &["a1"]))
            );
        }
        // Missed by the first pool: the next pool that meets it, narrowed.
        assert_eq!(
            choose(&plan, 0.5, Fallback, true),
            Choice::Target(1, narrowed("b", &["b1"]))
        );
        // Missed by every pool: the next provider (a burst), where one may take it.
        assert_eq!(
            choose(&plan, 0.05, Fallback, true),
            Choice::Target(2, provider())
        );
        assert_eq!(choose(&plan, 0.05, Fallback, false), Choice::Refuse);
        // Refuse and Serve look no further than the first pool.
        assert_eq!(choose(&plan, 0.5, Refuse, true), Choice::Refuse);
        assert_eq!(choose(&plan, 0.5, Serve, true), Choice::Keep);
        // A plan that starts with a provider is kept; a pool with no healthy worker meets nothing.
        assert_eq!(
            choose(&[provider(), pool("a")], 0.05, Refuse, true),
            Choice::Keep
        );
        assert_eq!(
            choose(&[pool("ghost")], 60.0, Fallback, true),
            Choice::Refuse
        );
    }
}
