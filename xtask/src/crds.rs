//! `cargo xtask gen-crds`: writes the CRD YAML generated from `kinference-crds` into `crds/`
//! (one file per CRD); `--check` only compares and fails when a committed file is stale.

use std::path::PathBuf;

use anyhow::{Context, bail};

#[derive(clap::Args)]
pub struct GenArgs {
    /// Fail if the committed YAML differs from the generated one, instead of writing it.
    #[arg(long)]
    pub check: bool,
}

fn crds_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../crds")
}

pub fn generate(args: GenArgs) -> anyhow::Result<()> {
    let dir = crds_dir();
    let mut stale = Vec::new();
    for (file, crd) in kinference_crds::all_crds() {
        let path = dir.join(file);
        let yaml = kinference_crds::render_yaml(&crd).context("rendering CRD YAML")?;
        let current = std::fs::read_to_string(&path).unwrap_or_default();
        if current == yaml {
            continue;
        }
        if args.check {
            stale.push(file);
        } else {
            std::fs::write(&path, yaml).with_context(|| format!("writing {}", path.display()))?;
            println!("wrote crds/{file}");
        }
    }
    if !stale.is_empty() {
        bail!(
            "stale CRD YAML: {}; run `cargo xtask gen-crds` and commit the result",
            stale.join(", ")
        );
    }
    if args.check {
        println!("CRD YAML is current");
    }
    Ok(())
}
