//! `cargo xtask build-ebpf`: builds the eBPF object that the agent embeds.

#[derive(clap::Args)]
pub struct BuildArgs {}

pub fn build(_args: BuildArgs) -> anyhow::Result<()> {
    anyhow::bail!("build-ebpf: the eBPF program is not written yet")
}
