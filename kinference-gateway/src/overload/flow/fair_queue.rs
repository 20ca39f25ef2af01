//! The waiting room of one pool: priority bands served strictly in order (high, medium, low), and
//! within a band deficit round robin between tenants by tokens, so a tenant that sends ten times the
//! tokens of another is let through no faster, in tokens, than its weight allows.
//!
//! Deficit round robin (Shreedhar and Varghese): each tenant with requests waiting has a deficit; on
//! its turn it gains `quantum x weight` tokens and sends its oldest requests while their cost fits in
//! the deficit; a tenant whose queue empties leaves the round and forgets its deficit. Requests are
//! taken one at a time ([`FairQueue::pop`]) because the pool's room is re-read between them.

use std::collections::VecDeque;
use std::time::Instant;

use kinference_crds::TenantPriority;

/// Number of bands.
pub const BANDS: usize = 3;

/// The bands from the first served to the last.
pub const ORDER: [TenantPriority; BANDS] = [
    TenantPriority::High,
    TenantPriority::Medium,
    TenantPriority::Low,
];

/// The index of `band` in [`ORDER`].
pub fn rank(band: TenantPriority) -> usize {
    match band {
        TenantPriority::High => 0,
        TenantPriority::Medium => 1,
        TenantPriority::Low => 2,
    }
}

/// One waiting request.
#[derive(Debug)]
pub struct Entry<T> {
    /// Unique in its queue.
    pub id: u64,
    /// Its band.
    pub band: TenantPriority,
    /// Its tenant (the flow it is fair within).
    pub tenant: String,
    /// What it costs its tenant's deficit: its prompt and reserved output tokens (at least 1).
    pub cost: u64,
    /// When it joined.
    pub since: Instant,
    /// When it is shed if still waiting.
    pub deadline: Instant,
    /// The caller's (a waker).
    pub item: T,
}

#[derive(Debug)]
struct Flow<T> {
    tenant: String,
    weight: u64,
    deficit: u64,
    /// Given its quantum for the current turn.
    credited: bool,
    entries: VecDeque<Entry<T>>,
}

#[derive(Debug)]
struct Band<T> {
    /// Tenants with requests waiting, in round order.
    flows: Vec<Flow<T>>,
    /// Whose turn it is.
    cursor: usize,
}

impl<T> Default for Band<T> {
    fn default() -> Self {
        Band {
            flows: Vec::new(),
            cursor: 0,
        }
    }
}

/// Waiting requests of one pool, by band and tenant.
#[derive(Debug)]
pub struct FairQueue<T> {
    bands: [Band<T>; BANDS],
    /// Tokens a tenant of weight 1 may send per turn.
    quantum: u64,
    len: usize,
}

impl<T> FairQueue<T> {
    /// An empty queue; `quantum` tokens per turn for weight 1.
    pub fn new(quantum: u64) -> Self {
        FairQueue {
            bands: Default::default(),
            quantum: quantum.max(1),
            len: 0,
        }
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No request waits.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The band [`FairQueue::pop`] takes from next.
    pub fn next_band(&self) -> Option<TenantPriority> {
        ORDER
            .into_iter()
            .find(|&band| !self.bands[rank(band)].flows.is_empty())
    }

    /// Whether a request of `band` or of a band above it waits.
    pub fn waiting_at_or_above(&self, band: TenantPriority) -> bool {
        self.bands[..=rank(band)]
            .iter()
            .any(|b| !b.flows.is_empty())
    }

    /// Requests waiting in `band`.
    pub fn band_len(&self, band: TenantPriority) -> usize {
        self.bands[rank(band)]
            .flows
            .iter()
            .map(|f| f.entries.len())
            .sum()
    }

    /// Requests of `tenant` waiting (every band).
    pub fn tenant_len(&self, tenant: &str) -> usize {
        self.bands
            .iter()
            .flat_map(|b| b.flows.iter())
            .filter(|f| f.tenant == tenant)
            .map(|f| f.entries.len())
            .sum()
    }

    /// Adds `entry` at the back of its tenant's queue in its band (`weight`: the tenant's, at least
    /// 1; the latest given counts).
    pub fn push(&mut self, entry: Entry<T>, weight: u32) {
        let band = &mut self.bands[rank(entry.band)];
        let weight = u64::from(weight.max(1));
        match band.flows.iter_mut().find(|f| f.tenant == entry.tenant) {
            Some(flow) => {
                flow.weight = weight;
                flow.entries.push_back(entry);
            }
            None => band.flows.push(Flow {
                tenant: entry.tenant.clone(),
                weight,
                deficit: 0,
                credited: false,
                entries: VecDeque::from([entry]),
            }),
        }
        self.len += 1;
    }

    /// The next request to let through: from the highest band with any, the tenant whose turn it is
    /// under deficit round robin.
    pub fn pop(&mut self) -> Option<Entry<T>> {
        let quantum = self.quantum;
        let band = self.bands.iter_mut().find(|b| !b.flows.is_empty())?;
        loop {
            if band.cursor >= band.flows.len() {
                band.cursor = 0;
            }
            let flow = &mut band.flows[band.cursor];
            let cost = flow.entries.front().map_or(0, |e| e.cost);
            if flow.deficit >= cost {
                flow.deficit -= cost;
                let entry = flow.entries.pop_front();
                if flow.entries.is_empty() {
                    band.flows.remove(band.cursor);
                }
                self.len -= 1;
                return entry;
            }
            if !flow.credited {
                // Its turn begins.
                flow.deficit += quantum * flow.weight;
                flow.credited = true;
                continue;
            }
            flow.credited = false;
            band.cursor += 1;
        }
    }

    /// Removes the request `id`, if it still waits.
    pub fn remove(&mut self, id: u64) -> Option<Entry<T>> {
        for band in &mut self.bands {
            for (f, flow) in band.flows.iter_mut().enumerate() {
                if let Some(i) = flow.entries.iter().position(|e| e.id == id) {
                    let entry = flow.entries.remove(i);
                    if flow.entries.is_empty() {
                        band.flows.remove(f);
                        if band.cursor > f {
                            band.cursor -= 1;
                        }
                    }
                    self.len -= 1;
                    return entry;
                }
            }
        }
        None
    }

    /// Removes and returns every request whose deadline has passed at `now`.
    pub fn expired(&mut self, now: Instant) -> Vec<Entry<T>> {
        let ids: Vec<u64> = self
            .bands
            .iter()
            .flat_map(|b| b.flows.iter())
            .flat_map(|f| f.entries.iter())
            .filter(|e| e.deadline <= now)
            .map(|e| e.id)
            .collect();
        ids.into_iter().filter_map(|id| self.remove(id)).collect()
    }

    /// The request to give up for an arrival of `band` when the queue is full: the newest of the
    /// lowest band below it with any, from its longest tenant queue (the heaviest user of it).
    pub fn displace_for(&mut self, band: TenantPriority) -> Option<Entry<T>> {
        let victim = self.bands[rank(band) + 1..]
            .iter()
            .rev()
            .find(|b| !b.flows.is_empty())?
            .flows
            .iter()
            .max_by_key(|f| f.entries.len())?
            .entries
            .back()?
            .id;
        self.remove(victim)
    }
}
