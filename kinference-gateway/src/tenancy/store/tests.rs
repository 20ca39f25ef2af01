use super::*;

fn record(id: &str) -> UsageRecord {
    UsageRecord {
        id: id.into(),
        ts_ms: 1,
        tenant: "t".into(),
        model: "m".into(),
        pool: String::new(),
        provider: String::new(),
        status: 200,
        requests: 1,
        input_uncached: 3,
        input_cached: 2,
        output: 1,
        cost: 0.5,
        estimated: false,
    }
}

#[tokio::test]
async fn the_journal_survives_a_restart_and_never_counts_a_request_twice() {
    let dir = std::env::temp_dir().join(format!("kinference-journal-{}", rand::random::<u64>()));
    let path = dir.join("usage.jsonl");
    {
        let (journal, replayed) = Journal::open(&path, None).unwrap();
        assert!(replayed.is_empty());
        journal.append(record("a"));
        journal.append(record("b"));
        journal.flush().await;
    }
    // A duplicate id and a torn last line, as a crash mid-write would leave.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(serde_json::to_string(&record("a")).unwrap().as_bytes())
        .unwrap();
    f.write_all(b"\n{\"id\":\"c\",\"ts_").unwrap();
    drop(f);
    let (journal, replayed) = Journal::open(&path, None).unwrap();
    let ids: Vec<&str> = replayed.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["a", "b"]);
    journal.flush().await;
    let _ = std::fs::remove_dir_all(&dir);
}

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
