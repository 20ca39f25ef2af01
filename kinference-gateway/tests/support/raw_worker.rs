//! Hand-written HTTP/1.1 workers for tests that need a worker misbehaving in one exact way (a stream
//! broken at a chosen point, a body past the gateway's limits): the request reader and the plain
//! answer they share.

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// Reads one HTTP/1.1 request (head and a Content-Length body): its path and body, `None` at EOF.
pub async fn read_request(s: &mut TcpStream) -> Option<(String, String)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            while buf.len() < end + 4 + length {
                let n = s.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            let path = head.split_whitespace().nth(1)?.to_string();
            let body = String::from_utf8_lossy(&buf[end + 4..end + 4 + length]).into_owned();
            return Some((path, body));
        }
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// A whole HTTP/1.1 answer (the connection closed after it) carrying one short chat completion of
/// `model`: "hi", 3 prompt tokens and 1 output token.
pub fn chat_completion_response(model: &str) -> String {
    let body = format!(
        r#"{{"id":"c","object":"chat.completion","created":0,"model":"{model}","choices":[{{"index":0,"message":{{"role":"assistant","content":"hi"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}}}"#
    );
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}
