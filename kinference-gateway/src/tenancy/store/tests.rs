use super::*;

#[test]
fn admission_answers_parse() {
    let ok = parse_admit(&["ok".into(), "1.5".into(), "-2".into()], 2);
    assert_eq!(
        ok,
        Some(RedisVerdict::Buckets(Verdict::Admitted(vec![
            Level { remaining: 1.5 },
            Level { remaining: -2.0 }
        ])))
    );
    let limited = parse_admit(
        &[
            "limited".into(),
            "0.25".into(),
            "1".into(),
            "3".into(),
            "0.5".into(),
        ],
        2,
    );
    assert!(matches!(
        limited,
        Some(RedisVerdict::Buckets(Verdict::Limited { refused: 1, .. }))
    ));
    assert_eq!(
        parse_admit(&["budget".into(), "12.5".into()], 0),
        Some(RedisVerdict::BudgetSpent(12.5))
    );
    assert_eq!(parse_admit(&["ok".into()], 1), None);
}
