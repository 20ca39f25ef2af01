use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

/// A loopback HTTP server answering each request with `answer(method and path, how many came
/// before)`: (status, body). Returns its base URL and the requests it saw.
async fn serve(
    answer: impl Fn(&str, usize) -> (u16, String) + Send + Sync + 'static,
) -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut request = Vec::new();
            let mut buf = [0; 4096];
            // One request per connection: the head, then as many body bytes as it announces.
            loop {
                let n = socket.read(&mut buf).await.unwrap_or(0);
                request.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&request);
                if let Some(end) = text.find("\r\n\r\n") {
                    let length = text[..end]
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse().unwrap_or(0))
                        })
                        .unwrap_or(0usize);
                    if request.len() >= end + 4 + length || n == 0 {
                        break;
                    }
                } else if n == 0 {
                    break;
                }
            }
            let text = String::from_utf8_lossy(&request);
            let line = text.split(" HTTP/").next().unwrap_or_default().to_string();
            let before = {
                let mut seen = log.lock().expect("log");
                seen.push(line.clone());
                seen.len() - 1
            };
            let (status, body) = answer(&line, before);
            let reply = format!(
                "HTTP/1.1 {status} X\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = socket.write_all(reply.as_bytes()).await;
        }
    });
    (url, seen)
}

fn sleeper(name: &str) -> Process {
    Process::adopt(
        name,
        Command::new("sleep").arg("30").spawn().expect("sleep"),
    )
}

#[tokio::test]
async fn wait_ready_returns_the_first_body_that_is_ready() {
    let (url, seen) = serve(|_, n| match n {
        0 => (503, "starting".into()),
        1 => (200, "warming".into()),
        _ => (200, "up".into()),
    })
    .await;
    let mut process = sleeper("server");
    let body = wait_ready(
        &HttpClient::new(),
        &mut process,
        &format!("{url}/health"),
        Duration::from_secs(10),
        |b| b == "up",
    )
    .await
    .expect("ready");
    assert_eq!(body, "up");
    assert_eq!(seen.lock().expect("log").len(), 3);
}

#[tokio::test]
async fn wait_ready_fails_at_once_when_the_process_exits_and_names_it() {
    let mut quitter = Process::adopt(
        "quitter",
        Command::new("sh")
            .args(["-c", "exit 3"])
            .spawn()
            .expect("sh"),
    );
    let started = Instant::now();
    let url = format!("http://127.0.0.1:{}/health", free_port());
    let error = wait_ready(
        &HttpClient::new(),
        &mut quitter,
        &url,
        Duration::from_secs(60),
        |_| true,
    )
    .await
    .expect_err("it exited");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert!(
        matches!(&error, HarnessError::Exited { name, status, .. } if name == "quitter" && status.contains('3')),
        "{error}"
    );
}

#[tokio::test]
async fn wait_ready_gives_up_after_its_timeout_naming_the_url() {
    let mut process = sleeper("silent");
    let url = format!("http://127.0.0.1:{}/health", free_port());
    let error = wait_ready(
        &HttpClient::new(),
        &mut process,
        &url,
        Duration::from_millis(300),
        |_| true,
    )
    .await
    .expect_err("nothing answers");
    assert!(
        matches!(&error, HarnessError::NotReady { name, what, .. } if name == "silent" && *what == url),
        "{error}"
    );
}

#[tokio::test]
async fn reset_retries_until_the_cache_is_empty_then_flushes_once() {
    let (url, seen) = serve(|line, n| match line {
        "GET /sim/state" if n < 4 => (200, r#"{"block_hashes":[7]}"#.into()),
        "GET /sim/state" => (200, r#"{"block_hashes":[]}"#.into()),
        _ => (200, "{}".into()),
    })
    .await;
    reset_prefix_cache(&HttpClient::new(), &url, "m")
        .await
        .expect("reset");
    assert_eq!(
        *seen.lock().expect("log"),
        [
            "POST /reset_prefix_cache",
            "GET /sim/state",
            "POST /reset_prefix_cache",
            "GET /sim/state",
            "POST /reset_prefix_cache",
            "GET /sim/state",
            "POST /v1/completions",
        ]
    );
}

#[test]
fn a_process_logs_and_its_group_stops_with_it() {
    let dir = std::env::temp_dir().join(format!("bench-harness-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let log = dir.join("group.log");
    let script = "sleep 30 & echo $!; wait".to_string();
    let mut process = Process::spawn_group(
        "group",
        std::path::Path::new("sh"),
        &["-c".into(), script],
        &[],
        log.clone(),
    )
    .expect("sh");
    let deadline = Instant::now() + Duration::from_secs(10);
    let sleeper = loop {
        let tail = process.log_tail();
        if let Some(pid) = tail.lines().next().filter(|l| !l.is_empty()) {
            break pid.to_string();
        }
        assert!(Instant::now() < deadline, "no pid in the log");
        std::thread::sleep(Duration::from_millis(20));
    };
    let running = |pid: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| {
            st.rsplit(')')
                .next()
                .is_some_and(|r| !r.trim_start().starts_with('Z'))
        })
    };
    assert!(running(&sleeper));
    assert!(process.exited().is_none());
    drop(process);
    while running(&sleeper) {
        assert!(
            Instant::now() < deadline,
            "sleep {sleeper} outlived its group"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
