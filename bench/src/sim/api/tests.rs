use serde_json::json;

use super::error::ApiError;
use super::openai::{PromptInput, parse_chat, parse_completion, usage};

#[test]
fn completion_prompts_of_every_shape() {
    let r = parse_completion(&json!({"prompt": "hi", "max_tokens": 3})).expect("text");
    assert!(matches!(r.prompt, PromptInput::Text(ref t) if t == "hi"));
    assert_eq!(r.max_tokens, Some(3));
    let r = parse_completion(&json!({"prompt": [1, 2, 3]})).expect("ids");
    assert!(matches!(r.prompt, PromptInput::Tokens(ref t) if t == &[1, 2, 3]));
    let r = parse_completion(&json!({"prompt": [[4, 5]]})).expect("nested ids");
    assert!(matches!(r.prompt, PromptInput::Tokens(ref t) if t == &[4, 5]));
}

#[test]
fn bad_requests_are_400_with_vllm_shape() {
    for body in [
        json!({}),
        json!({"prompt": 3}),
        json!({"prompt": "x", "max_tokens": -1}),
        json!({"prompt": "x", "max_tokens": 0}),
        json!({"prompt": "x", "n": 2}),
        json!({"prompt": "x", "stream_options": {"include_usage": true}}),
        json!({"prompt": ["a", "b"]}),
    ] {
        let e = parse_completion(&body).expect_err("must fail");
        assert_eq!(e.status(), 400, "{body}");
        let v = e.body();
        assert_eq!(v["error"]["type"], "BadRequestError");
        assert_eq!(v["error"]["code"], 400);
    }
    assert!(parse_chat(&json!({"messages": "hi"})).is_err());
}

#[test]
fn unknown_model_is_404_not_found_error() {
    let v = ApiError::ModelNotFound("nope".into()).body();
    assert_eq!(v["error"]["type"], "NotFoundError");
    assert_eq!(v["error"]["code"], 404);
    assert_eq!(v["error"]["message"], "The model `nope` does not exist.");
}

#[test]
fn usage_details_follow_the_flag() {
    assert_eq!(
        usage(100, 3, 96, true)["prompt_tokens_details"]["cached_tokens"],
        96
    );
    assert!(usage(100, 3, 96, false)["prompt_tokens_details"].is_null());
    assert_eq!(usage(100, 3, 96, true)["total_tokens"], 103);
}
