//! The shared crate's modules form layers at every level, as the gateway's do
//! (`kinference-gateway/tests/module_layers.rs`): no module imports a sibling that (directly or
//! not) imports it back.

use std::path::Path;

use testkit::layers::Layers;

#[test]
fn modules_import_each_other_in_layers_at_every_level() {
    let layers = Layers::scan(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    assert!(layers.module_count() >= 10, "{}", layers.module_count());
    layers.assert_no_circles(&[]);
}
