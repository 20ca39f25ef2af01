//! `kinfctl`: offline policy tooling (lint, test, explain). Being written.
fn main() {}
