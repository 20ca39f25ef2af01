use kinference_crds::Complexity;

use super::assess;

#[test]
fn short_factual_questions_are_simple() {
    let a = assess("What is the capital of France?", 1);
    assert_eq!(a.level, Complexity::Simple, "{a:?}");
    assert_eq!(a.score, 0);
}

#[test]
fn code_with_a_reasoning_cue_is_moderate() {
    let a = assess(
        "Why does this panic?\n```rust\nlet v: Vec<u8> = vec![];\nv[0];\n```",
        1,
    );
    assert_eq!(a.level, Complexity::Moderate, "{a:?}");
}

#[test]
fn long_design_work_with_code_is_complex() {
    let body = "word ".repeat(700);
    let text = format!(
        "Design the architecture step by step and compare the trade-off of each option.\n{body}\n```\nfn main() {{}}\n```"
    );
    let a = assess(&text, 1);
    assert_eq!(a.level, Complexity::Complex, "{a:?}");
    assert!(a.reasons.iter().any(|r| r.contains("code")));
}

#[test]
fn many_turns_add_a_point() {
    assert_eq!(assess("hi", 6).score, 1);
    assert_eq!(assess("hi", 5).score, 0);
}

#[test]
fn assessment_is_deterministic() {
    let text = "1. a\n2. b\n3. c\n4. d\n5. e\nanalyze these";
    assert_eq!(assess(text, 2), assess(text, 2));
    assert_eq!(assess(text, 2).score, 2);
}
