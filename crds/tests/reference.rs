//! The committed CRD reference must be what the schema generates.

use std::path::Path;

#[test]
fn committed_crd_reference_is_current() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../kinference-gateway/docs/crds.md");
    let generated = kinference_crds::reference::markdown();
    if std::env::var_os("KINFERENCE_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("writing docs/crds.md");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "kinference-gateway/docs/crds.md is stale: run \
         KINFERENCE_BLESS=1 cargo test -p kinference-crds --test reference"
    );
    // The fields this round added are documented.
    for field in [
        "spec.servesMessages",
        "spec.workerCredentials",
        "spec.workerHeaders",
    ] {
        assert!(generated.contains(&format!("| `{field}` |")), "{field}");
    }
}
