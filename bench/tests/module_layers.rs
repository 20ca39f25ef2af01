//! The bench crate's modules form layers at every level, as the gateway's do
//! (`kinference-gateway/tests/module_layers.rs`): among the top-level modules and among the
//! children of every module, no module imports a sibling that (directly or not) imports it back.

use std::path::Path;

use testkit::layers::Layers;

#[test]
fn modules_import_each_other_in_layers_at_every_level() {
    let layers = Layers::scan(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    // The scan is not blind: edges at the top and inside a module are seen.
    assert!(layers.graph("crate")["scale"].contains("routing"));
    assert!(layers.graph("crate::sim")["api"].contains("engine"));
    assert!(layers.module_count() >= 30, "{}", layers.module_count());
    layers.assert_no_circles(&[]);
}
