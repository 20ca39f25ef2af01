//! `cargo xtask demo` and `cargo xtask test`.

#[derive(clap::Args)]
pub struct DemoArgs {}

#[derive(clap::Args)]
pub struct TestArgs {}

pub fn demo(_args: DemoArgs) -> anyhow::Result<()> {
    anyhow::bail!("demo: not written yet")
}

pub fn test(_args: TestArgs) -> anyhow::Result<()> {
    anyhow::bail!("test: not written yet")
}
