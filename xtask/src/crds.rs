//! `cargo xtask gen-crds`: writes the CRD YAML generated from `kinference-crds`.

#[derive(clap::Args)]
pub struct GenArgs {
    /// Fail if the committed YAML differs from the generated one, instead of writing it.
    #[arg(long)]
    pub check: bool,
}

pub fn generate(_args: GenArgs) -> anyhow::Result<()> {
    anyhow::bail!("gen-crds: the CRD types are not written yet")
}
