use std::process::Command;

use super::*;

#[test]
fn free_ports_are_distinct() {
    let ports = free_ports(20);
    let distinct: std::collections::HashSet<_> = ports.iter().collect();
    assert_eq!(distinct.len(), 20);
    assert!(ports.iter().all(|p| PORTS.contains(&u32::from(*p))));
}

#[test]
fn a_stopped_child_is_reaped_and_stopping_again_is_harmless() {
    let mut guard = ChildGuard(Command::new("sleep").arg("30").spawn().expect("sleep"));
    guard.stop();
    assert!(guard.0.try_wait().is_ok_and(|s| s.is_some()), "reaped");
    guard.stop();
}
