use super::*;

#[test]
fn percentile_interpolates_like_numpy() {
    let v = [1.0, 2.0, 3.0, 4.0];
    assert_eq!(percentile(&v, 50.0), 2.5);
    // numpy.percentile([1,2,3,4], 90) == 3.7
    assert!((percentile(&v, 90.0) - 3.7).abs() < 1e-12);
    assert_eq!(percentile(&[1.0, 5.0, 9.0], 50.0), 5.0);
    assert_eq!(percentile(&[7.0], 90.0), 7.0);
    assert!(percentile(&[], 50.0).is_nan());
    let ten: Vec<f64> = (1..=10).map(f64::from).collect();
    assert!((percentile(&ten, 90.0) - 9.1).abs() < 1e-12);
    // numpy.percentile(range(1, 101), 99) == 99.01
    let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
    assert!((percentile(&hundred, 99.0) - 99.01).abs() < 1e-9);
    assert_eq!(percentile(&v, 0.0), 1.0);
    assert_eq!(percentile(&v, 100.0), 4.0);
    assert_eq!(percentile(&v, 150.0), 4.0, "clamped");
}

#[test]
fn duration_forms_agree_with_the_f64_one() {
    let d: Vec<Duration> = [1u64, 2, 3, 4].map(Duration::from_millis).to_vec();
    assert!((percentile_ms(&d, 90.0) - 3.7).abs() < 1e-9);
    assert_eq!(percentile_duration(&d, 50.0), Duration::from_micros(2500));
    assert!(percentile_ms(&[], 50.0).is_nan());
    assert_eq!(percentile_duration(&[], 99.0), Duration::ZERO);
}

#[test]
fn median_sorts_and_averages_the_middle_pair() {
    assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    assert_eq!(median(&mut [9.0, 1.0, 5.0]), 5.0);
    assert!(median(&mut []).is_nan());
}
