//! The in-flight gate: at most `limit` requests hold a [`Slot`] at once, and near the limit some
//! headroom is kept for higher-priority tenants. Each priority has a ceiling (high: the limit;
//! medium: the limit less one reserve; low: less two); a request above its ceiling waits in a
//! bounded queue for a short time, then is shed. A freed slot goes to the highest-priority waiter
//! whose ceiling allows it, so under pressure low-priority requests are the ones that time out.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use kinference_crds::TenantPriority;
use parking_lot::Mutex;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::oneshot;

/// How many requests the gate admits, and how long one may wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateSettings {
    /// Most requests holding a slot at once (high priority may use all of them).
    pub limit: usize,
    /// Slots kept free of medium-priority requests (and twice that of low-priority ones).
    pub reserve: usize,
    /// Most requests waiting for a slot at once; past it, a request is shed at once.
    pub queue_capacity: usize,
    /// Longest wait for a slot before the request is shed.
    pub queue_timeout: Duration,
}

/// Why a request was shed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    /// Above its priority's ceiling, and the wait queue was full.
    QueueFull,
    /// Above its priority's ceiling, and no slot came free within the queue timeout.
    QueueTimeout,
}

impl Shed {
    /// Label value of the shed counter.
    pub fn as_str(self) -> &'static str {
        match self {
            Shed::QueueFull => "queue_full",
            Shed::QueueTimeout => "queue_timeout",
        }
    }
}

/// The priorities from the first served to the last.
const ORDER: [TenantPriority; 3] = [
    TenantPriority::High,
    TenantPriority::Medium,
    TenantPriority::Low,
];

fn rank(priority: TenantPriority) -> usize {
    match priority {
        TenantPriority::High => 0,
        TenantPriority::Medium => 1,
        TenantPriority::Low => 2,
    }
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    /// A `()` sent here hands the waiter a slot already counted in `in_flight`.
    wake: oneshot::Sender<()>,
}

#[derive(Debug, Default)]
struct State {
    in_flight: usize,
    /// One FIFO queue per priority, in [`ORDER`].
    queues: [VecDeque<Waiter>; 3],
    next_id: u64,
}

impl State {
    fn queued(&self) -> usize {
        self.queues.iter().map(VecDeque::len).sum()
    }

    /// Removes waiter `id` of `priority`; whether it was still queued.
    fn remove(&mut self, priority: TenantPriority, id: u64) -> bool {
        let queue = &mut self.queues[rank(priority)];
        match queue.iter().position(|w| w.id == id) {
            Some(i) => {
                queue.remove(i);
                true
            }
            None => false,
        }
    }
}

/// The gate (shared by every request of the API port).
#[derive(Debug)]
pub struct Gate {
    settings: GateSettings,
    state: Mutex<State>,
    in_flight: Gauge,
    queued: Gauge,
}

impl Gate {
    /// A gate with `settings`, reporting on the two gauges.
    pub fn new(settings: GateSettings, in_flight: Gauge, queued: Gauge) -> Arc<Self> {
        Arc::new(Gate {
            settings,
            state: Mutex::new(State::default()),
            in_flight,
            queued,
        })
    }

    /// Most requests of `priority` in flight before it has to wait.
    fn ceiling(&self, priority: TenantPriority) -> usize {
        let below = self.settings.reserve * rank(priority);
        self.settings.limit.saturating_sub(below).max(1)
    }

    /// Requests holding a slot now.
    pub fn in_flight(&self) -> usize {
        self.state.lock().in_flight
    }

    /// A slot for a request of `priority`: at once while it is under its ceiling and no request of
    /// the same or a higher priority is waiting; else after a wait of at most the queue timeout.
    pub async fn admit(self: &Arc<Self>, priority: TenantPriority) -> Result<Slot, Shed> {
        let (id, wake) = {
            let mut state = self.state.lock();
            let ahead = state.queues[..=rank(priority)]
                .iter()
                .any(|q| !q.is_empty());
            if !ahead && state.in_flight < self.ceiling(priority) {
                state.in_flight += 1;
                self.publish(&state);
                return Ok(self.slot());
            }
            if state.queued() >= self.settings.queue_capacity
                || self.settings.queue_timeout.is_zero()
            {
                return Err(Shed::QueueFull);
            }
            let id = state.next_id;
            state.next_id += 1;
            let (tx, rx) = oneshot::channel();
            state.queues[rank(priority)].push_back(Waiter { id, wake: tx });
            self.publish(&state);
            (id, rx)
        };
        let mut waiting = Waiting {
            gate: Arc::clone(self),
            priority,
            id,
            wake: Some(wake),
        };
        let woken = match waiting.wake.as_mut() {
            Some(wake) => tokio::time::timeout(self.settings.queue_timeout, wake).await,
            None => return Err(Shed::QueueTimeout),
        };
        match woken {
            Ok(Ok(())) => {
                waiting.wake = None;
                Ok(self.slot())
            }
            // Timed out: settled under the lock in `Waiting::finish`.
            _ if waiting.finish() => Ok(self.slot()),
            _ => Err(Shed::QueueTimeout),
        }
    }

    fn slot(self: &Arc<Self>) -> Slot {
        Slot {
            gate: Arc::clone(self),
        }
    }

    /// A slot came free: hands it (and any other the ceilings now allow) to the waiters, highest
    /// priority first.
    fn release(&self) {
        let mut state = self.state.lock();
        state.in_flight = state.in_flight.saturating_sub(1);
        for priority in ORDER {
            while state.in_flight < self.ceiling(priority) {
                let Some(waiter) = state.queues[rank(priority)].pop_front() else {
                    break;
                };
                if waiter.wake.send(()).is_ok() {
                    state.in_flight += 1;
                }
            }
        }
        self.publish(&state);
    }

    fn publish(&self, state: &State) {
        self.in_flight.set(state.in_flight as i64);
        self.queued.set(state.queued() as i64);
    }
}

/// A request's place under the in-flight limit, given back when dropped (also when a stream is cut
/// or the client goes away).
#[derive(Debug)]
pub struct Slot {
    gate: Arc<Gate>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gate.release();
    }
}

/// A queued request. Dropped before it settled (the client went away while it waited), it leaves
/// the queue, or gives back the slot it was handed just then.
struct Waiting {
    gate: Arc<Gate>,
    priority: TenantPriority,
    id: u64,
    /// `None` once settled.
    wake: Option<oneshot::Receiver<()>>,
}

impl Waiting {
    /// Settles the wait under the gate's lock: `true` when a slot was handed over after all (it is
    /// the caller's now), `false` when the waiter left the queue without one.
    fn finish(&mut self) -> bool {
        let Some(mut wake) = self.wake.take() else {
            return false;
        };
        let mut state = self.gate.state.lock();
        if state.remove(self.priority, self.id) {
            self.gate.publish(&state);
            return false;
        }
        // Not queued any more: `release` popped it, and sent a slot unless the send failed.
        wake.try_recv().is_ok()
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if self.wake.is_some() && self.finish() {
            // A slot handed to a request that is gone: pass it on.
            self.gate.release();
        }
    }
}

#[cfg(test)]
mod tests;
