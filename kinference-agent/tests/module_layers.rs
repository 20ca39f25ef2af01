//! The agent's modules form layers at every level, as the gateway's do
//! (`kinference-gateway/tests/module_layers.rs`): bytes flow one way, and no module imports a
//! sibling that (directly or not) imports it back.

use std::path::Path;

use testkit::layers::Layers;

#[test]
fn modules_import_each_other_in_layers_at_every_level() {
    let layers = Layers::scan(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    // The scan is not blind: the summary stream's reading of the registry is seen.
    assert!(layers.graph("crate")["grpc"].contains("registry"));
    assert!(layers.module_count() >= 20, "{}", layers.module_count());
    layers.assert_no_circles(&[]);
}
