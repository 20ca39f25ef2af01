//! The one percentile every benchmark reports, so p50/p90/p99 figures in different results files compare.
//!
//! Definition: linear interpolation between the closest ranks, numpy's default (`method="linear"`, R's
//! type 7, Excel's `PERCENTILE.INC`). For `n` sorted values `x[0..n]` the `p`-th percentile sits at rank
//! `h = p / 100 * (n - 1)` and is `x[floor(h)] + (h - floor(h)) * (x[ceil(h)] - x[floor(h)])`: p0 is the
//! minimum, p100 the maximum, p50 the usual median (the mean of the two middle values for an even count).
//! It never reports a value between samples as a sample, but with few samples the tail percentiles are
//! interpolated, not observed: report the sample count beside them.

use std::time::Duration;

/// The `p`-th percentile (0..=100, clamped) of `sorted` (ascending); `NaN` for no values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        1 => sorted[0],
        n => {
            let rank = (p / 100.0).clamp(0.0, 1.0) * (n - 1) as f64;
            let lo = rank.floor() as usize;
            let hi = rank.ceil() as usize;
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

/// [`percentile`] of sorted durations, in milliseconds; `NaN` for no values.
pub fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
    let ms: Vec<f64> = sorted.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    percentile(&ms, p)
}

/// [`percentile`] of sorted durations; zero for no values.
pub fn percentile_duration(sorted: &[Duration], p: f64) -> Duration {
    let secs: Vec<f64> = sorted.iter().map(Duration::as_secs_f64).collect();
    match percentile(&secs, p) {
        s if s.is_nan() => Duration::ZERO,
        s => Duration::from_secs_f64(s),
    }
}

/// The median (p50) of `values`, sorting them first; `NaN` for no values.
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    percentile(values, 50.0)
}

#[cfg(test)]
mod tests;
