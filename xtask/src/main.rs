//! Project tasks, run as `cargo xtask <task>`.
//!
//! - `setup`: fetch what the demo and tests need on a fresh machine (tokenizer, Python clients).
//! - `demo`: simulated vLLM workers + agent + gateway on loopback, a workload, and the comparison.
//! - `test`: the whole test suite (Rust and the Python SDK end-to-end tests).
//! - `build-ebpf`: build the agent's eBPF object.
//! - `gen-crds`: regenerate the CRD YAML in `crds/` from the Rust types.
//! - `images`: build the gateway, agent and vllm-sim container images (buildah, no daemon).

mod crds;
mod ebpf;
mod images;
mod setup;
mod tasks;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "Kinference project tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Fetch the tokenizer and install the Python test clients (idempotent).
    Setup,
    /// Run the local demo: simulated workers, agent, gateway, a workload and the comparison.
    Demo(tasks::DemoArgs),
    /// Run every test: cargo tests, then the Python end-to-end tests.
    Test(tasks::TestArgs),
    /// Build the eBPF object embedded by the agent.
    BuildEbpf(ebpf::BuildArgs),
    /// Regenerate (or with --check, verify) the CRD YAML under crds/.
    GenCrds(crds::GenArgs),
    /// Build the container images (gateway + kinfctl, agent + eBPF, vllm-sim) as archives under target/images.
    Images(images::ImagesArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().task {
        Task::Setup => setup::run().map(|_| ()),
        Task::Demo(args) => tasks::demo(args),
        Task::Test(args) => tasks::test(args),
        Task::BuildEbpf(args) => ebpf::build(args),
        Task::GenCrds(args) => crds::generate(args),
        Task::Images(args) => images::build(args),
    }
}
