use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::*;

/// A worker whose `/tokenize` answers 200 and then sends `{"tokens":[1,1,1,...` without end.
async fn endless_tokenize() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = [0u8; 4096];
                let _ = s.read(&mut head).await;
                let start = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
                let mut out = start.as_bytes().to_vec();
                let first = b"{\"tokens\":[1";
                out.extend(format!("{:x}\r\n", first.len()).as_bytes());
                out.extend(first);
                out.extend(b"\r\n");
                if s.write_all(&out).await.is_err() {
                    return;
                }
                let piece = ",1".repeat(32 << 10);
                let framed = format!("{:x}\r\n{piece}\r\n", piece.len());
                while s.write_all(framed.as_bytes()).await.is_ok() {}
            });
        }
    });
    url
}

#[tokio::test]
async fn a_workers_tokenize_answer_is_read_up_to_a_multiple_of_the_question() {
    let url = endless_tokenize().await;
    let tokenizers = Tokenizers::load(std::iter::empty()).expect("no tokenizer to load");
    let started = Instant::now();
    let answer = tokenizers
        .tokens("m", Prompt::Text("hello world"), Some(&url))
        .await;
    let took = started.elapsed();
    let Err(TokensError::Remote { message, .. }) = answer else {
        panic!("an endless answer is refused: {answer:?}");
    };
    // Refused once past the bound, long before the 2 s timeout (which is all there was before).
    assert!(message.contains("at most"), "{message}");
    assert!(took < Duration::from_secs(1), "{took:?}: {message}");
}

#[tokio::test]
async fn token_id_prompts_are_their_own_tokens_with_no_tokenizer_or_worker() {
    // No local tokenizer, no worker to ask: the ids are the tokens (before: an empty prompt, so a
    // token-id request never found its cached prefix).
    let tokenizers = Tokenizers::load(std::iter::empty()).expect("no tokenizer to load");
    let ids: Vec<serde_json::Value> = [151_644u64, 872, 198, 9707].map(Into::into).to_vec();
    let (tokens, source) = tokenizers
        .tokens("m", Prompt::Ids(&ids), None)
        .await
        .expect("given ids");
    assert_eq!(tokens, vec![151_644, 872, 198, 9707]);
    assert!(matches!(source, Source::Given));
    // Routing keys only what precedes a value that is not a token id.
    let bad: Vec<serde_json::Value> = vec![5.into(), "x".into(), 6.into()];
    let (tokens, _) = tokenizers
        .tokens("m", Prompt::Ids(&bad), None)
        .await
        .unwrap();
    assert_eq!(tokens, vec![5]);
}
