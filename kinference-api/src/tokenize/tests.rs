use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

use serde_json::json;

use super::*;

fn tokenizer_dir() -> PathBuf {
    std::env::var_os("KINFERENCE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.assets/qwen2"))
}

fn qwen2() -> &'static ModelTokenizer {
    static TOK: OnceLock<ModelTokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = tokenizer_dir();
        ModelTokenizer::from_dir(&dir).unwrap_or_else(|e| {
            panic!(
                "Qwen2 tokenizer missing at {}: {e}; run `cargo xtask setup`",
                dir.display()
            )
        })
    })
}

#[test]
fn text_ids_equal_live_vllm_tokenize() {
    let ids = qwen2()
        .encode_text("Hello world, this is a test.", true)
        .expect("encode");
    assert_eq!(ids, vec![9707, 1879, 11, 419, 374, 264, 1273, 13]);
}

#[test]
fn chat_ids_equal_live_vllm_tokenize() {
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let text = qwen2().render_chat(&msgs, true).expect("render");
    assert_eq!(
        text,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = qwen2().encode_chat(&msgs).expect("encode");
    assert_eq!(
        ids,
        vec![151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198]
    );
}

#[test]
fn system_prompt_renders_as_python_jinja() {
    let msgs = json!([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi"},
    ]);
    let text = qwen2().render_chat(&msgs, true).expect("render");
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let no_gen = qwen2().render_chat(&msgs, false).expect("render");
    assert!(no_gen.ends_with("<|im_start|>user\nHi<|im_end|>\n"));
}

#[test]
fn multi_turn_with_think_block_uses_python_string_methods() {
    // Exercises `.split()`, `.lstrip()`, `.strip()`, `.startswith()` and `messages[::-1]`.
    let msgs = json!([
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
    ]);
    let text = qwen2().render_chat(&msgs, true).expect("render");
    assert_eq!(
        text,
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n\
         <|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn content_parts_are_flattened_like_vllm() {
    let parts = json!([{"role": "user", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}
    ]}]);
    let plain = json!([{"role": "user", "content": "Hello\nworld"}]);
    assert_eq!(
        qwen2().render_chat(&parts, true).expect("parts"),
        qwen2().render_chat(&plain, true).expect("plain")
    );
}

#[test]
fn bad_messages_are_typed_errors() {
    for bad in [
        json!({"role": "user"}),
        json!([]),
        json!([{"content": "x"}]),
        json!([{"role": "user", "content": 3}]),
        json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
    ] {
        let err = qwen2().render_chat(&bad, true).expect_err("must fail");
        assert!(
            matches!(err, TokenizeError::InvalidMessages(_)),
            "{bad}: {err}"
        );
    }
}

#[test]
fn missing_dir_says_how_to_fix() {
    let err = ModelTokenizer::from_dir("/nonexistent/tokenizer").expect_err("must fail");
    assert!(err.to_string().contains("cargo xtask setup"), "{err}");
}

#[test]
fn long_chat_prompt_encodes_quickly() {
    // About 8k tokens of varied English-like text: the gateway's hot path.
    let words = [
        "router", "cache", "token", "prefix", "worker", "latency", "the", "of", "and", "model",
    ];
    let mut text = String::new();
    let mut x: u64 = 7;
    while text.len() < 40_000 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        text.push_str(words[(x >> 33) as usize % words.len()]);
        text.push_str(if (x >> 40).is_multiple_of(11) {
            ". "
        } else {
            " "
        });
    }
    let msgs =
        json!([{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]);
    let tok = qwen2();
    let n = tok.encode_chat(&msgs).expect("encode").len();
    assert!(n > 6_000, "only {n} tokens");
    let runs = 5;
    let start = Instant::now();
    for _ in 0..runs {
        tok.encode_chat(&msgs).expect("encode");
    }
    let per = start.elapsed() / runs;
    // Unoptimised `tokenizers` is ~100x slower, so debug builds only catch pathological regressions;
    // `cargo test --release` checks the real target (a few ms for ~8k tokens).
    let bound = if cfg!(debug_assertions) { 3_000 } else { 5 };
    assert!(
        per.as_millis() < bound,
        "{n} tokens took {per:?} per encode_chat"
    );
}

#[test]
#[ignore = "profiling aid: cargo test --release -- --ignored profile_encode --nocapture"]
fn profile_encode() {
    let words = [
        "router", "cache", "token", "prefix", "worker", "latency", "the", "of",
    ];
    let mut text = String::new();
    let mut x: u64 = 7;
    while text.len() < 40_000 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        text.push_str(words[(x >> 33) as usize % words.len()]);
        text.push(' ');
    }
    let tok = qwen2();
    let msgs = json!([{"role": "user", "content": text}]);
    let t = Instant::now();
    let rendered = tok.render_chat(&msgs, true).expect("render");
    println!("render {:?}", t.elapsed());
    for _ in 0..3 {
        let t = Instant::now();
        let n = tok.encode_text(&rendered, false).expect("enc").len();
        println!("encode_fast {n} tokens {:?}", t.elapsed());
    }
    let t = Instant::now();
    let n = tok
        .tokenizer()
        .encode(rendered.as_str(), false)
        .expect("enc")
        .len();
    println!("encode {n} {:?}", t.elapsed());
    let t = Instant::now();
    let pre = tok.tokenizer().get_pre_tokenizer().expect("pre");
    use tokenizers::PreTokenizer;
    let mut pts = tokenizers::PreTokenizedString::from(rendered.as_str());
    pre.pre_tokenize(&mut pts).expect("pre");
    println!("pre_tokenize only {:?}", t.elapsed());
    let t = Instant::now();
    let _ = tok.tokenizer().get_normalizer().map(|n| {
        use tokenizers::Normalizer;
        let mut s = tokenizers::NormalizedString::from(rendered.as_str());
        n.normalize(&mut s).expect("norm");
    });
    println!("normalize only {:?}", t.elapsed());
}

#[test]
fn fast_path_equals_the_full_pipeline() {
    let tok = qwen2();
    assert!(
        tok.fast.is_some(),
        "Qwen2's pipeline must take the fast path"
    );
    let mut cases: Vec<String> = [
        "Hello world, this is a test.",
        "it's they're we've I'm you'll he'd IT'S 'x ''s",
        "a  b   c    d\n\ne\r\n f \t\tg \n  \n  h",
        "trailing spaces   ",
        "   leading",
        "x = foo(bar[1], 23456) + 7.5e-3; // done!!\n\n\n",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "tags <think>\nhmm\n</think> and <tool_call>{\"a\": 1}</tool_call> <|unknown|>",
        "naïve café — ünïcödé mixed with ascii 😀 text",
        "\u{b}\u{c}vertical\u{b} tabs\u{7f} del _under_score__",
        "",
        " ",
        "\n",
        "'",
        "' s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // Random ASCII soup over the characters the scanner distinguishes.
    let alphabet: Vec<char> = "aZ9 '\n\r\t.,!_-<|>sSlLdD".chars().collect();
    let mut x: u64 = 99;
    for _ in 0..300 {
        let mut s = String::new();
        for _ in 0..40 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            s.push(alphabet[(x >> 33) as usize % alphabet.len()]);
        }
        cases.push(s);
    }
    for text in &cases {
        for special in [false, true] {
            assert_eq!(
                tok.encode_text(text, special).expect("fast"),
                tok.encode_text_reference(text, special).expect("reference"),
                "{text:?}"
            );
        }
    }
}

#[test]
fn repeated_long_segments_come_from_the_cache_with_the_same_ids() {
    let tok = qwen2();
    let fast = tok
        .fast
        .as_ref()
        .expect("Qwen2's pipeline must take the fast path");
    // A long system prompt (one segment between added tokens; the text no other test uses) and short
    // questions around it.
    let system: String = (0..400)
        .map(|i| format!("Cache rule {i}: answer politely, cite section {}.\n", i * 7))
        .collect();
    let segment = format!("system\n{system}");
    assert!(!fast.is_cached(&segment));
    for question in [
        "Where is my parcel?",
        "How do I return an item?",
        "Where is my parcel?",
    ] {
        let text = format!(
            "<|im_start|>{segment}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            tok.encode_text(&text, false).expect("fast"),
            tok.encode_text_reference(&text, false).expect("reference"),
        );
        assert!(fast.is_cached(&segment));
        assert!(
            !fast.is_cached(&format!("user\n{question}")),
            "short segments are not cached"
        );
    }
    // A segment that differs in one byte is its own entry, not a wrong hit.
    let changed = segment.replacen("Cache rule 399", "Cache rule 398", 1);
    let text = format!("<|im_start|>{changed}<|im_end|>\n");
    assert!(!fast.is_cached(&changed));
    assert_eq!(
        tok.encode_text(&text, false).expect("fast"),
        tok.encode_text_reference(&text, false).expect("reference"),
    );
    assert!(fast.is_cached(&changed) && fast.is_cached(&segment));
}

#[test]
fn encode_within_declines_long_new_text_and_takes_cached_text_free() {
    let tok = qwen2();
    // A long system prompt no other test uses, then a short question.
    let system: String = (0..500)
        .map(|i| format!("Budget rule {i}: keep replies under {} words.\n", i + 20))
        .collect();
    let chat = |question: &str| {
        json!([
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ])
    };
    let budget = 4 * 1024;
    assert!(system.len() > 4 * budget);
    // New: more new text than the budget, so nothing is encoded (and nothing cached); the rendered
    // prompt comes back for a full encode elsewhere.
    let first = chat("What is the limit?");
    let rendered = ChatTokens::Rendered(tok.render_chat(&first, true).expect("render"));
    assert_eq!(
        tok.encode_chat_within(&first, budget).expect("encode"),
        rendered
    );
    assert_eq!(
        tok.encode_chat_within(&first, budget).expect("encode"),
        rendered,
        "a declined encode must not fill the cache"
    );
    // An unbounded encode caches the system prompt; then only the question is new.
    let full = tok.encode_chat(&first).expect("encode");
    assert_eq!(
        tok.encode_chat_within(&first, budget).expect("encode"),
        ChatTokens::Ids(full)
    );
    let second = chat("And for code blocks?");
    assert_eq!(
        tok.encode_chat_within(&second, budget).expect("encode"),
        ChatTokens::Ids(tok.encode_chat(&second).expect("encode")),
    );
    // With no budget at all, even the question's short segment is declined.
    assert!(matches!(
        tok.encode_chat_within(&second, 0).expect("encode"),
        ChatTokens::Rendered(_)
    ));
    // Plain text follows the same rule, and the result equals the full pipeline's.
    let text = format!("{system}Tell me more.");
    assert_eq!(
        tok.encode_text_within(&text, true, budget).expect("encode"),
        None
    );
    assert_eq!(
        tok.encode_text_within(&text, true, usize::MAX)
            .expect("encode"),
        Some(tok.encode_text_reference(&text, true).expect("reference")),
    );
}

#[test]
fn a_repeated_render_equals_a_fresh_one_and_a_changed_input_renders_anew() {
    let fresh = ModelTokenizer::from_dir(tokenizer_dir()).expect("Qwen2 tokenizer");
    let chat = json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say something about latency."}
    ]);
    let first = fresh.render_chat(&chat, true).unwrap();
    // The second render comes from the cache; it must equal the template's own.
    assert_eq!(fresh.render_chat(&chat, true).unwrap(), first);
    assert_eq!(qwen2().render_chat(&chat, true).unwrap(), first);
    // Every input of the render is part of what is looked up.
    let without_prompt = fresh.render_chat(&chat, false).unwrap();
    assert_ne!(without_prompt, first);
    assert_eq!(without_prompt, qwen2().render_chat(&chat, false).unwrap());
    let changed = json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say something about latency!"}
    ]);
    assert!(
        fresh
            .render_chat(&changed, true)
            .unwrap()
            .contains("latency!")
    );
    let kwargs = json!({"add_vision_id": true, "enable_thinking": false});
    let with_kwargs = fresh.render_chat_with(&chat, true, Some(&kwargs)).unwrap();
    assert_eq!(
        with_kwargs,
        qwen2()
            .render_chat_with(&chat, true, Some(&kwargs))
            .unwrap()
    );
    // Invalid input is still refused on a second try (errors are never kept).
    let bad = json!([{"content": "no role"}]);
    assert!(fresh.render_chat(&bad, true).is_err());
    assert!(fresh.render_chat(&bad, true).is_err());
}
