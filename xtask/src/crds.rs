//! `cargo xtask gen-crds`: writes the CRD YAML generated from `kinference-crds` into `crds/`
//! (one file per CRD) and into the `kinference-crds` Helm chart, which ships the same files;
//! `--check` only compares and fails when a committed file is stale.

use anyhow::{Context, bail};
use testkit::repo_root;

#[derive(clap::Args)]
pub struct GenArgs {
    /// Fail if the committed YAML differs from the generated one, instead of writing it.
    #[arg(long)]
    pub check: bool,
}

/// Every folder that holds the generated CRDs, relative to the repository root.
const CRD_DIRS: &[&str] = &["crds", "deploy/charts/kinference-crds/crds"];

pub fn generate(args: GenArgs) -> anyhow::Result<()> {
    let root = repo_root();
    let mut stale = Vec::new();
    for (file, crd) in kinference_crds::all_crds() {
        let yaml = kinference_crds::render_yaml(&crd).context("rendering CRD YAML")?;
        for dir in CRD_DIRS {
            let shown = format!("{dir}/{file}");
            let path = root.join(&shown);
            let current = std::fs::read_to_string(&path).unwrap_or_default();
            if current == yaml {
                continue;
            }
            if args.check {
                stale.push(shown);
            } else {
                std::fs::write(&path, &yaml)
                    .with_context(|| format!("writing {}", path.display()))?;
                println!("wrote {shown}");
            }
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
