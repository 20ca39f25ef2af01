use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::{StreamedBody, stream};
use crate::api::openai::Usage;
use crate::backend::relay::Meter;
use crate::backend::worker::{HttpSettings, Upstream};

/// What the stream reported: text chunks and the end (status, output tokens).
#[derive(Default)]
struct Heard {
    chunks: usize,
    end: Option<(u16, Option<u64>)>,
    /// The answer's id, as told.
    id: Option<String>,
}

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Heard>>);

impl Meter for Recorder {
    fn text_chunk(&mut self, _text: &str) {
        self.0.lock().expect("lock").chunks += 1;
    }

    fn finish(&mut self, status: u16, usage: Option<&Usage>) {
        self.0.lock().expect("lock").end = Some((status, usage.map(|u| u.completion_tokens)));
    }

    fn answer_id(&mut self, id: String) {
        let mut heard = self.0.lock().expect("lock");
        assert!(heard.id.is_none(), "the id is told once");
        heard.id = Some(id);
    }
}

/// A worker on loopback that answers every request with `body` as an event stream.
async fn worker(body: &'static str) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = service_fn(move |_req| async move {
                    let mut r =
                        hyper::Response::new(Full::new(Bytes::from_static(body.as_bytes())));
                    r.headers_mut()
                        .insert("content-type", "text/event-stream".parse().expect("value"));
                    Ok::<_, std::convert::Infallible>(r)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), service)
                    .await;
            });
        }
    });
    url
}

/// The client's bytes and what the meter heard, for a worker answering `body`.
async fn relayed(body: &'static str) -> (String, Heard) {
    let url = worker(body).await;
    let upstream = Upstream::new(&HttpSettings::default());
    let response = upstream
        .post_json(&url, "/v1/responses", Bytes::from_static(b"{}"))
        .await
        .expect("answered");
    let recorder = Recorder::default();
    let streamed = StreamedBody {
        body: response.into_body(),
        worker: url,
    };
    let out = stream(streamed, Duration::from_secs(10), recorder.clone())
        .collect()
        .await
        .expect("body")
        .to_bytes();
    let heard = std::mem::take(&mut *recorder.0.lock().expect("lock"));
    (String::from_utf8_lossy(&out).into_owned(), heard)
}

const DELTA: &str = "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\" hi\"}\n\n";

#[tokio::test]
async fn a_complete_stream_passes_unchanged_and_settles_with_its_usage() {
    const BODY: &str = concat!(
        "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\"}}\n\n",
        "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\" hi\"}\n\n",
        "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\" yo\"}\n\n",
        "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_1\",\"usage\":{\"input_tokens\":5,\"output_tokens\":2}}}\n\n",
    );
    let (out, heard) = relayed(BODY).await;
    assert_eq!(out, BODY);
    assert_eq!(heard.chunks, 2);
    assert_eq!(heard.end, Some((200, Some(2))));
    // The id a later request may continue, read once from `response.created`.
    assert_eq!(heard.id.as_deref(), Some("resp_1"));
}

#[tokio::test]
async fn a_stream_cut_before_its_final_event_ends_with_an_openai_error() {
    let (out, heard) = relayed(DELTA).await;
    assert!(out.starts_with(DELTA), "{out}");
    assert!(out.contains("\"error\""), "{out}");
    assert_eq!(heard.chunks, 1);
    assert_eq!(heard.end, Some((502, None)));
}
