//! One request's end, settled once: the gateway's metrics, the router's in-flight ticket and the
//! tenant's admission live in one [`Settlement`], made when the request arrives and fed as it goes
//! (`admitted`, `worker` / `provider`, `chunk`), ended by `finish(status, usage)`. A settlement
//! dropped without `finish` (the client went away, or the response body was dropped mid-stream)
//! records the request once as abandoned (499).
//!
//! Worker and provider answers are settled the same way; a provider answer is billed at the
//! provider's price and counted against the tenant's limits and budget.
//!
//! A backend that reports no usage (a worker that ignores `include_usage`, a response the ext_proc
//! door never saw) is not billed zero: the settlement counts it itself, the prompt by the gateway's
//! tokenizer, the output by the relayed text (tokenized by the model's tokenizer, else one token
//! per text chunk), or, for a successful answer it never saw, the output reserved at admission; the
//! usage record says `estimated`.
//!
//! The settlement writes the request's access line (target `kinference_gateway::access_log`):
//! method, path, status, tenant, model, backend, tokens, duration and request id, once per request.

use std::time::Instant;

use crate::api::openai::Usage;
use crate::backend::provider::ProviderClient;
use crate::backend::relay::Meter;
use crate::errors::Protocol;
use crate::metrics::{InFlightGuard, Metrics, ModelWorkerLabels, RequestLabels};
use crate::overload::budget::BodyReservation;
use crate::overload::gate::Slot;
use crate::routing::InFlight;
use crate::telemetry::{RequestContext, RequestId};
use crate::tenancy::Admission;
use kinference_api::tokenize::ModelTokenizer;

/// The most relayed text kept to count an answer whose backend reported no usage; past it the rest
/// counts one token per text chunk.
const COUNTED_TEXT_BYTES: usize = 256 * 1024;

/// Everything one request owes the gateway's books, settled exactly once.
pub struct Settlement {
    metrics: Metrics,
    protocol: Protocol,
    started: Instant,
    /// `model`: the model the client asked for; `worker`: the backend's label (worker URL or
    /// `provider/<name>`, empty before one is chosen). Kept whole: every text chunk uses them.
    labels: ModelWorkerLabels,
    /// A backend's answer is being relayed: latency and tokens are recorded with the status.
    relaying: bool,
    last_text: Option<Instant>,
    ticket: Option<InFlight>,
    admission: Option<Admission>,
    /// The request's place under the gateway's in-flight limit, freed with the settlement.
    _slot: Option<Slot>,
    /// The room its body holds in the body-byte budget, freed with the settlement.
    body: Option<BodyReservation>,
    /// Its pass through the flow control: its end wakes the pool's queue.
    _flow: Option<crate::overload::flow::Passed>,
    /// The router's count of the prompt, once routed.
    prompt_tokens: Option<u64>,
    /// What the answer said so far (for an answer without usage), and its text chunks.
    counted: CountedOutput,
    _in_flight: InFlightGuard,
    settled: bool,
    /// The id of the answer the worker made, which a later request may continue.
    answer_id: Option<String>,
    /// The request's id (access line, usage record) and root span (held until the answer's last
    /// byte, so the exported span covers the stream).
    request: Option<(RequestId, tracing::Span)>,
    /// The client's path (access line).
    path: std::sync::Arc<str>,
}

impl std::fmt::Debug for Settlement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settlement")
            .field("model", &self.labels.model)
            .field("backend", &self.labels.worker)
            .field("settled", &self.settled)
            .finish()
    }
}

impl Settlement {
    /// A request arrived (counted in flight until it is settled); its id and path are the current
    /// request's ([`RequestContext::current`]) when there is one.
    pub fn new(metrics: &Metrics, protocol: Protocol) -> Self {
        let context = RequestContext::current();
        Settlement {
            metrics: metrics.clone(),
            protocol,
            started: Instant::now(),
            labels: ModelWorkerLabels {
                model: String::new(),
                worker: String::new(),
            },
            relaying: false,
            last_text: None,
            ticket: None,
            admission: None,
            _slot: None,
            body: None,
            _flow: None,
            prompt_tokens: None,
            counted: CountedOutput::default(),
            _in_flight: metrics.in_flight(),
            settled: false,
            answer_id: None,
            path: context
                .as_ref()
                .map_or_else(|| std::sync::Arc::from(""), |c| c.path.clone()),
            request: context.map(|c| (c.id, tracing::Span::none())),
        }
    }

    /// The request's id and root span, and the client's path.
    pub fn request(&mut self, id: RequestId, path: &'static str, span: tracing::Span) {
        self.request = Some((id, span));
        self.path = std::sync::Arc::from(path);
    }

    /// When the request arrived.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// The model the client asked for (metric label).
    pub fn model(&mut self, model: &str) {
        self.labels.model = model.to_string();
    }

    /// The request's in-flight slot, held until the answer's last byte (or the client leaves).
    pub fn hold(&mut self, slot: Slot) {
        self._slot = Some(slot);
    }

    /// The request's pass through the flow control, held until the request ends.
    pub fn hold_flow(&mut self, passed: crate::overload::flow::Passed) {
        self._flow = Some(passed);
    }

    /// The room the request's body holds in the body-byte budget, kept until the request ends.
    pub fn hold_body(&mut self, body: BodyReservation) {
        self.body = Some(body);
    }

    /// The body's reservation, to add to it.
    pub fn take_body_reservation(&mut self) -> Option<BodyReservation> {
        self.body.take()
    }

    /// Bytes the body holds in the budget.
    pub fn body_bytes_held(&self) -> usize {
        self.body.as_ref().map_or(0, BodyReservation::bytes)
    }

    /// The answer's tokens are billed (`bills`: an answer without usage is counted, with the
    /// model's `tokenizer` when the gateway has it); an endpoint that bills the request alone
    /// (tokenizing) has nothing to count.
    pub fn counting_with(
        &mut self,
        bills: bool,
        tokenizer: Option<std::sync::Arc<ModelTokenizer>>,
    ) {
        self.counted.bills = bills;
        self.counted.tokenizer = tokenizer;
    }

    /// The answer passes where the gateway cannot see it (Envoy relays it without the response
    /// phase): unless it is seen after all, a success is billed its reservation.
    pub fn answer_unseen(&mut self, unseen: bool) {
        self.counted.unseen = unseen;
    }

    /// The tenant's admission, settled with the request.
    pub fn admitted(&mut self, mut admission: Admission) {
        if let Some((id, _)) = &self.request {
            admission.request_id(id.as_str());
        }
        self.admission = Some(admission);
    }

    /// The tenant's admission, when admitted.
    pub fn admission(&self) -> Option<&Admission> {
        self.admission.as_ref()
    }

    /// The tenant's rate-limit headers for a served response.
    pub fn tenancy_headers(&self) -> http::HeaderMap {
        self.admission
            .as_ref()
            .map(|a| a.headers())
            .unwrap_or_default()
    }

    /// A worker took the request: the router's ticket is released with the request; the router's
    /// own prompt count corrects the tenant's estimate.
    pub fn worker(
        &mut self,
        worker: &str,
        reason: &str,
        prompt_tokens: Option<usize>,
        ticket: InFlight,
    ) {
        self.labels.worker = worker.to_string();
        self.ticket = Some(ticket);
        self.prompt_tokens = prompt_tokens.map(|n| n as u64);
        if let Some(admission) = &mut self.admission {
            admission.routed(worker, reason, prompt_tokens);
        }
    }

    /// The prefill of a split request (prefill/decode disaggregation) ran on `worker`, which
    /// reported `usage`: the prompt is billed by it, once, when the decode worker's answer settles
    /// the request.
    pub fn prefilled(&mut self, worker: &str, usage: Option<&Usage>) {
        if let Some(admission) = &mut self.admission {
            admission.prefilled(worker, usage);
        }
    }

    /// The request went to another worker after the first broke its stream before any output
    /// ([`crate::backend::relay::Resend`]): the new worker's ticket replaces the first's (released
    /// as it drops) and the new worker is the one the request is counted and recorded under.
    pub fn moved(&mut self, worker: &str, ticket: InFlight) {
        self.labels.worker = worker.to_string();
        self.ticket = Some(ticket);
        if let Some(admission) = &mut self.admission {
            admission.moved(worker);
        }
    }

    /// The plan's pool serves `model` (the served name behind an alias or class, or another
    /// model): the tenant's per-model limits and price follow it.
    pub fn served(&mut self, model: &str) {
        if let Some(admission) = &mut self.admission {
            admission.serving(model);
        }
    }

    /// A provider took the request as `model` (its model name): billed at its price.
    pub fn provider(&mut self, client: &ProviderClient, model: &str) {
        self.labels.worker = client.label();
        if let Some(admission) = &mut self.admission {
            admission.provider(client.name(), client.prices(model));
        }
    }

    /// The backend's answer is relayed from now on: the end records latency and tokens.
    pub fn relaying(&mut self) {
        self.relaying = true;
    }

    /// The first token arrived (also called by [`Settlement::chunk`]).
    pub fn first_token(&mut self) {
        if self.last_text.is_some() {
            return;
        }
        let now = Instant::now();
        self.metrics
            .ttft(&self.labels, now.duration_since(self.started).as_secs_f64());
        if let Some(ticket) = &mut self.ticket {
            ticket.first_token();
        }
        self.last_text = Some(now);
    }

    /// A chunk carrying `text` passed: first token, then inter-token latency; the tenant's
    /// streamed output.
    pub fn chunk_text(&mut self, text: &str) {
        self.counted.add(text);
        self.chunk();
    }

    /// A chunk carrying text passed: first token, then inter-token latency; the tenant's streamed
    /// output.
    pub fn chunk(&mut self) {
        self.counted.chunks += 1;
        self.counted.unseen = false;
        if let Some(admission) = &mut self.admission {
            admission.text_chunk();
        }
        match self.last_text {
            None => self.first_token(),
            Some(last) => {
                let now = Instant::now();
                self.metrics
                    .itl(&self.labels, now.duration_since(last).as_secs_f64());
                self.last_text = Some(now);
            }
        }
    }

    /// The worker's answer is the stored answer `id` (`/v1/responses`): a success tells the router
    /// which worker holds it ([`crate::routing::InFlight::answered`]).
    pub fn answer_id(&mut self, id: String) {
        self.answer_id = Some(id);
    }

    /// The request ended with `status` and the backend's `usage` (once; later calls do nothing).
    pub fn finish(&mut self, status: u16, usage: Option<&Usage>) {
        if std::mem::replace(&mut self.settled, true) {
            return;
        }
        let counted;
        let usage = match usage {
            Some(u) if u.prompt_tokens > 0 || u.completion_tokens > 0 => Some(u),
            _ if self.counted.bills && self.reached_backend() && (200..300).contains(&status) => {
                counted = self.counted_usage();
                if let Some(admission) = &mut self.admission {
                    admission.estimated();
                }
                Some(&counted)
            }
            other => other,
        };
        self.access_line(status, usage);
        if let Some(admission) = self.admission.take() {
            admission.settle(status, usage);
        }
        let labels = &self.labels;
        let usage = usage.copied().unwrap_or_default();
        let cached = usage.cached_tokens();
        if self.relaying {
            self.metrics
                .e2e(labels, self.started.elapsed().as_secs_f64());
            self.metrics.tokens(
                labels,
                usage.prompt_tokens,
                usage.completion_tokens,
                cached.unwrap_or(0),
            );
        }
        self.metrics.request(RequestLabels {
            model: labels.model.clone(),
            worker: labels.worker.clone(),
            status,
            protocol: self.protocol.as_str(),
        });
        if let Some(ticket) = self.ticket.take() {
            if let Some(id) = self
                .answer_id
                .take()
                .filter(|_| (200..300).contains(&status))
            {
                ticket.answered(&id);
            }
            ticket.finish(
                (200..300).contains(&status),
                usize::try_from(usage.completion_tokens).unwrap_or(usize::MAX),
                cached.and_then(|c| usize::try_from(c).ok()),
            );
        }
    }
}

impl Settlement {
    /// Whether a backend took the request.
    fn reached_backend(&self) -> bool {
        !self.labels.worker.is_empty()
    }

    /// The usage of an answer whose backend reported none: the router's prompt count (else the
    /// admission's), and the output counted from the relayed text, else its chunks, else (an answer
    /// never seen) the reservation.
    fn counted_usage(&self) -> Usage {
        let prompt = self
            .prompt_tokens
            .or_else(|| self.admission.as_ref().map(Admission::input_estimate))
            .unwrap_or(0);
        let reserved = self
            .admission
            .as_ref()
            .map_or(0, Admission::output_reserved);
        let output =
            self.counted
                .tokens()
                .unwrap_or(if self.counted.unseen { reserved } else { 0 });
        Usage {
            prompt_tokens: prompt,
            completion_tokens: output,
            total_tokens: prompt + output,
            prompt_tokens_details: None,
        }
    }

    /// The request's access line, in its span.
    fn access_line(&self, status: u16, usage: Option<&Usage>) {
        let none = tracing::Span::none();
        let (id, span) = match &self.request {
            Some((id, span)) => (id.as_str(), span),
            None => ("", &none),
        };
        let usage = usage.copied().unwrap_or_default();
        span.in_scope(|| {
            tracing::info!(
                target: "kinference_gateway::access_log",
                method = "POST",
                path = &*self.path,
                status,
                tenant = self.admission.as_ref().map_or("", |a| a.tenant()),
                model = %self.labels.model,
                backend = %self.labels.worker,
                input_tokens = usage.prompt_tokens,
                cached_tokens = usage.cached_tokens().unwrap_or(0),
                output_tokens = usage.completion_tokens,
                duration_ms = self.started.elapsed().as_millis() as u64,
                request_id = id,
                "request"
            );
        });
    }
}

/// The answer as the gateway saw it pass, for a backend that reports no usage.
#[derive(Default)]
struct CountedOutput {
    text: String,
    /// Text chunks seen (past [`COUNTED_TEXT_BYTES`] of text, one token each).
    chunks: u64,
    /// Chunks whose text was not kept.
    uncounted: u64,
    tokenizer: Option<std::sync::Arc<ModelTokenizer>>,
    /// No part of the answer was seen (yet).
    unseen: bool,
    /// The endpoint bills tokens (an answer without usage is counted); not tokenizing's.
    bills: bool,
}

impl CountedOutput {
    fn add(&mut self, text: &str) {
        if self.text.len() + text.len() <= COUNTED_TEXT_BYTES {
            self.text.push_str(text);
        } else {
            self.uncounted += 1;
        }
    }

    /// Output tokens: the kept text tokenized (plus a token per chunk not kept), else one per
    /// chunk; `None` when nothing was seen.
    fn tokens(&self) -> Option<u64> {
        if self.chunks == 0 {
            return None;
        }
        let counted = match &self.tokenizer {
            Some(t) if !self.text.is_empty() => t
                .encode_text(&self.text, false)
                .ok()
                .map(|ids| ids.len() as u64 + self.uncounted),
            _ => None,
        };
        Some(counted.unwrap_or(self.chunks).max(1))
    }
}

impl Meter for Settlement {
    fn text_chunk(&mut self, text: &str) {
        self.chunk_text(text);
    }

    fn finish(&mut self, status: u16, usage: Option<&Usage>) {
        Settlement::finish(self, status, usage);
    }

    fn answer_id(&mut self, id: String) {
        Settlement::answer_id(self, id);
    }
}

impl Drop for Settlement {
    fn drop(&mut self) {
        if !self.settled {
            // The client went away before the end: 499, the ticket released as failed.
            tracing::debug!(backend = %self.labels.worker, model = %self.labels.model, "request abandoned");
            self.finish(499, None);
        }
    }
}

#[cfg(test)]
mod tests;
