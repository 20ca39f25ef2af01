//! A deterministic prompt-complexity classifier.
//!
//! Score, from the prompt's text (all messages) and its turn count:
//! - length: +1 from 150 words, +2 from 600, +3 from 2000 (long prompts need more context work);
//! - code: +2 when the prompt holds code (a ``` fence, or 3+ lines that look like code);
//! - reasoning cues: +1 per distinct cue ("step by step", "prove", "why", "analyze", "compare",
//!   "trade-off", "design", "derive", "optimize", "debug", "refactor", "architecture", ...), at most +3;
//! - structure: +1 for 3+ questions or 5+ bullet/numbered items (several tasks at once);
//! - conversation: +1 from 6 turns.
//!
//! Levels: `Simple` below 2, `Moderate` 2 to 4, `Complex` from 5. The same text always gets the
//! same level, so `kinfctl test` cases are stable.

use kinference_crds::Complexity;
use serde::Serialize;

#[cfg(test)]
mod tests;

/// Phrases that indicate multi-step reasoning or design work.
const REASONING_CUES: &[&str] = &[
    "step by step",
    "step-by-step",
    "prove",
    "proof",
    "why ",
    "analyze",
    "analyse",
    "compare",
    "trade-off",
    "tradeoff",
    "design",
    "derive",
    "optimize",
    "optimise",
    "debug",
    "refactor",
    "architecture",
    "evaluate",
    "justify",
    "explain how",
    "root cause",
    "plan ",
];

/// The level and the features that produced it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ComplexityAssessment {
    pub level: Complexity,
    pub score: u32,
    /// Human-readable reasons, e.g. `"code (+2)"`.
    pub reasons: Vec<String>,
}

/// Classifies a prompt. `turns` is the number of messages (1 for a plain completion prompt).
pub fn assess(text: &str, turns: usize) -> ComplexityAssessment {
    let mut score = 0;
    let mut reasons = Vec::new();
    let words = text.split_whitespace().count();
    let length_points = match words {
        w if w >= 2000 => 3,
        w if w >= 600 => 2,
        w if w >= 150 => 1,
        _ => 0,
    };
    if length_points > 0 {
        score += length_points;
        reasons.push(format!("{words} words (+{length_points})"));
    }
    if has_code(text) {
        score += 2;
        reasons.push("code (+2)".into());
    }
    let lower = text.to_lowercase();
    let cues: Vec<&str> = REASONING_CUES
        .iter()
        .copied()
        .filter(|c| lower.contains(c))
        .collect();
    let cue_points = cues.len().min(3) as u32;
    if cue_points > 0 {
        score += cue_points;
        reasons.push(format!("reasoning cues {cues:?} (+{cue_points})"));
    }
    let questions = text.matches('?').count();
    let items = text
        .lines()
        .map(str::trim_start)
        .filter(|l| {
            l.starts_with("- ")
                || l.starts_with("* ")
                || l.split_once(". ").is_some_and(|(n, _)| {
                    !n.is_empty() && n.len() <= 2 && n.bytes().all(|b| b.is_ascii_digit())
                })
        })
        .count();
    if questions >= 3 || items >= 5 {
        score += 1;
        reasons.push(format!("{questions} questions, {items} list items (+1)"));
    }
    if turns >= 6 {
        score += 1;
        reasons.push(format!("{turns} turns (+1)"));
    }
    let level = match score {
        0..=1 => Complexity::Simple,
        2..=4 => Complexity::Moderate,
        _ => Complexity::Complex,
    };
    ComplexityAssessment {
        level,
        score,
        reasons,
    }
}

fn has_code(text: &str) -> bool {
    if text.contains("```") {
        return true;
    }
    let code_lines = text
        .lines()
        .map(str::trim)
        .filter(|l| {
            l.ends_with(';')
                || l.ends_with('{')
                || l == &"}"
                || l.starts_with("def ")
                || l.starts_with("fn ")
                || l.starts_with("class ")
                || l.starts_with("import ")
                || l.starts_with("#include")
                || l.starts_with("return ")
        })
        .count();
    code_lines >= 3
}
