//! The scale benchmark (`scale-bench`): what the gateway costs as the fleet grows from 3 to 100+
//! simulated workers, eight per simulated node with one real agent each.
//!
//! [`fleet`] starts the processes, [`probe`] reads CPU, memory and the gateway's decision histogram,
//! [`report`] writes the table and the SVG plot.

pub mod fleet;
pub mod probe;
pub mod report;
