//! Overload protection: what bounds the work a gateway accepts before memory or workers run out.
//!
//! - open connections per port ([`ConnectionLimit`]): past the limit a connection gets one quick
//!   503 (`Connection: close`), or, when too many such answers are under way, is closed at once;
//!   the admin port has its own, smaller limit so `/metrics` and the probes keep answering;
//! - requests in flight ([`gate::Gate`]): past a tenant priority's ceiling a request waits briefly
//!   in a bounded queue, then is shed with 503 in the client's protocol and `Retry-After`, before
//!   its body is read; both front doors, HTTP and ext_proc, admit through the same gate
//!   ([`Admitter`]), so a request through Envoy holds a slot like any other;
//! - request bodies held at once ([`budget::BodyBudget`]): in all and per tenant, reserved before a
//!   body is read and again for what its JSON costs once parsed; past it a request waits briefly,
//!   then is shed (503, `Retry-After`);
//! - a client that stops reading its answer ([`io::StallGuard`]): its connection is cut after the
//!   write deadline, which drops the upstream request (the worker frees its slot).
//!
//! - requests to a saturated pool ([`flow::FlowControl`], `--flow-control`): held in the gateway in
//!   priority bands, fair between tenants by tokens, let through as the pool gets room, shed (429/503
//!   with `Retry-After`) past their band's deadline; the saturation detector ([`flow::saturation`])
//!   reads the agents' engine and kernel figures.
//!
//! The request-body read deadline and the bounded upstream pool per worker are knobs of
//! [`crate::backend::worker::HttpSettings`], beside the other timeouts of the HTTP path.

pub mod budget;
pub mod flow;
pub mod gate;
pub mod io;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kinference_api::metrics::Described;
use kinference_crds::TenantPriority;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use budget::{BodyBudget, BodyReservation, BudgetSettings};
use gate::{Gate, GateSettings, Shed, Slot};

/// Limits on open connections and requests in flight (flags of `kinference-gateway`).
#[derive(Debug, Clone, clap::Args)]
pub struct OverloadSettings {
    /// Most open connections on the API port; past it a new connection gets one 503 and is closed.
    #[arg(long, env = "KINFERENCE_MAX_CONNECTIONS", default_value_t = 20_000)]
    pub max_connections: usize,

    /// Most open connections on the admin port (its own limit, so `/metrics` and the probes keep
    /// answering while the API port is full).
    #[arg(long, env = "KINFERENCE_ADMIN_MAX_CONNECTIONS", default_value_t = 256)]
    pub admin_max_connections: usize,

    /// Most inference requests in flight (from admission to the last byte of the answer); 0: no
    /// limit. High-priority tenants may use all of it.
    #[arg(long, env = "KINFERENCE_MAX_IN_FLIGHT", default_value_t = 4_096)]
    pub max_in_flight: usize,

    /// Share of `--max-in-flight`, in percent, kept free of medium-priority requests; twice it is
    /// kept free of low-priority ones.
    #[arg(long, env = "KINFERENCE_PRIORITY_RESERVE_PERCENT", default_value_t = 10,
        value_parser = clap::value_parser!(u8).range(0..50))]
    pub priority_reserve_percent: u8,

    /// Most requests waiting for an in-flight slot; past it a request is shed at once.
    #[arg(long, env = "KINFERENCE_OVERLOAD_QUEUE", default_value_t = 256)]
    pub overload_queue: usize,

    /// Longest wait for an in-flight slot, in milliseconds, before the request is shed (503).
    #[arg(
        long,
        env = "KINFERENCE_OVERLOAD_QUEUE_TIMEOUT_MS",
        default_value_t = 250
    )]
    pub overload_queue_timeout_ms: u64,

    /// Bytes all request bodies may hold at once, their parsed JSON included (see
    /// `overload::budget`); past it a request waits up to the queue timeout, then is shed (503).
    #[arg(long, env = "KINFERENCE_BODY_BUDGET_BYTES", default_value_t = 512 << 20)]
    pub body_budget_bytes: usize,

    /// Bytes one tenant's request bodies may hold at once (the open gateway's callers share one
    /// tenant's share); past it that tenant's requests wait, then are shed, while others go on.
    #[arg(long, env = "KINFERENCE_TENANT_BODY_BUDGET_BYTES", default_value_t = 128 << 20)]
    pub tenant_body_budget_bytes: usize,

    /// `Retry-After` of a shed request, in seconds.
    #[arg(
        long,
        env = "KINFERENCE_OVERLOAD_RETRY_AFTER_SECONDS",
        default_value_t = 1
    )]
    pub overload_retry_after_seconds: u64,

    /// Flow control: requests held in the gateway while their pool is saturated.
    #[command(flatten)]
    pub flow: flow::FlowSettings,
}

impl Default for OverloadSettings {
    fn default() -> Self {
        // The clap defaults: parse an empty command line.
        #[derive(clap::Parser)]
        struct Only {
            #[command(flatten)]
            overload: OverloadSettings,
        }
        <Only as clap::Parser>::parse_from(["kinference-gateway"]).overload
    }
}

impl OverloadSettings {
    /// The in-flight gate's settings; `None` when there is no in-flight limit.
    pub fn gate(&self) -> Option<GateSettings> {
        (self.max_in_flight > 0).then(|| GateSettings {
            limit: self.max_in_flight,
            reserve: self.max_in_flight * usize::from(self.priority_reserve_percent) / 100,
            queue_capacity: self.overload_queue,
            queue_timeout: Duration::from_millis(self.overload_queue_timeout_ms),
        })
    }
}

/// A request the gateway will not take now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    /// `connections`, `queue_full` or `queue_timeout`.
    pub reason: &'static str,
    /// `Retry-After`, in seconds.
    pub retry_after_s: u64,
}

/// Labels of the shed counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShedLabels {
    /// Why: `connections`, `queue_full`, `queue_timeout`.
    reason: &'static str,
    /// The tenant's priority (`none` for a connection shed before any request was read).
    priority: &'static str,
}

/// Labels of the connection gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PortLabels {
    /// `api` or `admin`.
    port: &'static str,
}

/// Everything of overload protection the servers and the pipeline share.
#[derive(Debug)]
pub struct Overload {
    admitter: Admitter,
    /// Request bodies' memory.
    bodies: BodyBudget,
    /// The API port's connections.
    pub api: ConnectionLimit,
    /// The admin port's connections.
    pub admin: ConnectionLimit,
    /// Requests held while their pool is saturated.
    pub flow: flow::FlowControl,
}

/// The in-flight gate and its shed counter: what a front door admits requests through. Clones
/// share the gate, so the HTTP pipeline and the ext_proc handler count against one limit.
#[derive(Debug, Clone)]
pub struct Admitter {
    gate: Option<Arc<Gate>>,
    shed: Family<ShedLabels, Counter>,
    retry_after_s: u64,
}

impl Overload {
    /// The limits of `settings`, their metrics registered as `kinference_gateway_overload_*`,
    /// `kinference_gateway_open_connections` and `kinference_gateway_shed`.
    pub fn new(settings: OverloadSettings, registry: &mut Registry) -> Self {
        let in_flight = Gauge::default();
        let queued = Gauge::default();
        let connections = Family::<PortLabels, Gauge>::default();
        let shed = Family::<ShedLabels, Counter>::default();
        let r = registry.sub_registry_with_prefix("kinference_gateway");
        r.register(
            "overload_in_flight",
            "Inference requests holding an in-flight slot (the limit is --max-in-flight)",
            Described(in_flight.clone()),
        );
        r.register(
            "overload_queued",
            "Inference requests waiting for an in-flight slot",
            Described(queued.clone()),
        );
        r.register(
            "open_connections",
            "Open client connections by port (api, admin)",
            Described(connections.clone()),
        );
        r.register(
            "shed",
            "Requests and connections refused with 503 because the gateway is at its limits, by reason and tenant priority",
            Described(shed.clone()),
        );
        let bodies_held = Gauge::default();
        r.register(
            "body_bytes_held",
            "Bytes reserved by request bodies in flight, their parsed JSON included (the budget is --body-budget-bytes)",
            Described(bodies_held.clone()),
        );
        let gate = settings.gate().map(|g| Gate::new(g, in_flight, queued));
        let flow = flow::FlowControl::new(settings.flow.clone(), registry);
        let bodies = BodyBudget::new(
            BudgetSettings {
                total: settings.body_budget_bytes,
                per_tenant: settings.tenant_body_budget_bytes,
                wait: Duration::from_millis(settings.overload_queue_timeout_ms),
            },
            bodies_held,
        );
        // One statement each: the family's read guard must be gone before the next label is made.
        let api_open = connections
            .get_or_create(&PortLabels { port: "api" })
            .clone();
        let admin_open = connections
            .get_or_create(&PortLabels { port: "admin" })
            .clone();
        Overload {
            flow,
            bodies,
            api: ConnectionLimit::new(settings.max_connections, api_open),
            admin: ConnectionLimit::new(settings.admin_max_connections, admin_open),
            admitter: Admitter {
                gate,
                shed,
                retry_after_s: settings.overload_retry_after_seconds,
            },
        }
    }

    /// An in-flight slot for a request of `priority` (`None`: no in-flight limit), or the refusal.
    pub async fn admit(&self, priority: TenantPriority) -> Result<Option<Slot>, Refused> {
        self.admitter.admit(priority).await
    }

    /// Adds `bytes` of `tenant`'s request body to `held`, or the refusal (503 with `Retry-After`,
    /// counted as shed for `body_budget`) when there is no room within the queue timeout.
    pub async fn reserve_body(
        &self,
        held: &mut BodyReservation,
        tenant: &str,
        bytes: usize,
        priority: TenantPriority,
    ) -> Result<(), Refused> {
        self.bodies
            .reserve(held, tenant, bytes)
            .await
            .map_err(|no_room| {
                tracing::debug!(
                    tenant,
                    bytes,
                    scope = no_room.scope,
                    "request body shed: no room in the body budget"
                );
                self.admitter.refuse_reason("body_budget", priority)
            })
    }

    /// The body budget's settings.
    pub fn body_budget(&self) -> BudgetSettings {
        self.bodies.settings()
    }

    /// Bytes request bodies hold in the body budget now.
    pub fn body_bytes_held(&self) -> usize {
        self.bodies.held()
    }

    /// The in-flight gate, for another front door (ext_proc) to admit through.
    pub fn admitter(&self) -> Admitter {
        self.admitter.clone()
    }

    /// A connection refused because its port is full (counted).
    pub fn connection_refused(&self) -> Refused {
        self.admitter
            .shed
            .get_or_create(&ShedLabels {
                reason: "connections",
                priority: "none",
            })
            .inc();
        Refused {
            reason: "connections",
            retry_after_s: self.admitter.retry_after_s,
        }
    }

    /// Requests holding an in-flight slot now (0 without a limit).
    pub fn in_flight(&self) -> usize {
        self.admitter.in_flight()
    }
}

impl Admitter {
    /// An in-flight slot for a request of `priority` (`None`: no in-flight limit), or the refusal.
    pub async fn admit(&self, priority: TenantPriority) -> Result<Option<Slot>, Refused> {
        let Some(gate) = &self.gate else {
            return Ok(None);
        };
        match gate.admit(priority).await {
            Ok(slot) => Ok(Some(slot)),
            Err(shed) => Err(self.refuse(shed, priority)),
        }
    }

    /// Requests holding an in-flight slot now (0 without a limit).
    pub fn in_flight(&self) -> usize {
        self.gate.as_ref().map_or(0, |g| g.in_flight())
    }

    fn refuse(&self, shed: Shed, priority: TenantPriority) -> Refused {
        self.refuse_reason(shed.as_str(), priority)
    }

    fn refuse_reason(&self, reason: &'static str, priority: TenantPriority) -> Refused {
        self.shed
            .get_or_create(&ShedLabels {
                reason,
                priority: priority.as_str(),
            })
            .inc();
        tracing::debug!(reason, priority = priority.as_str(), "request shed");
        Refused {
            reason,
            retry_after_s: self.retry_after_s,
        }
    }
}

/// The open connections of one port, bounded.
#[derive(Debug)]
pub struct ConnectionLimit {
    limit: usize,
    open: Arc<AtomicUsize>,
    gauge: Gauge,
    /// Over-limit connections being answered 503 right now; past the limit's share, closed at once.
    refusing: Arc<AtomicUsize>,
}

impl ConnectionLimit {
    fn new(limit: usize, gauge: Gauge) -> Self {
        ConnectionLimit {
            limit,
            open: Arc::default(),
            gauge,
            refusing: Arc::default(),
        }
    }

    /// A place for a new connection, held until the guard drops; `None` when the port is full.
    pub fn try_open(&self) -> Option<ConnectionGuard> {
        Self::take(&self.open, self.limit).map(|open| {
            self.gauge.inc();
            ConnectionGuard {
                open,
                gauge: Some(self.gauge.clone()),
            }
        })
    }

    /// A place to answer an over-limit connection with one 503 (a sixteenth of the limit, at
    /// least 16); `None`: close it without an answer.
    pub fn try_refuse(&self) -> Option<ConnectionGuard> {
        Self::take(&self.refusing, (self.limit / 16).max(16))
            .map(|open| ConnectionGuard { open, gauge: None })
    }

    fn take(count: &Arc<AtomicUsize>, limit: usize) -> Option<Arc<AtomicUsize>> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()
            .map(|_| Arc::clone(count))
    }
}

/// One open connection's place, given back when the connection ends.
#[derive(Debug)]
pub struct ConnectionGuard {
    open: Arc<AtomicUsize>,
    gauge: Option<Gauge>,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
        if let Some(gauge) = &self.gauge {
            gauge.dec();
        }
    }
}

#[cfg(test)]
mod tests;
