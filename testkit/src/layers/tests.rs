use std::path::{Path, PathBuf};

use super::source::{NamedPath, code_only, rooted_paths, without_test_modules};
use super::{Layers, module_of};

/// A crate's `src` in a temporary folder, removed on drop.
struct Src(PathBuf);

impl Src {
    fn new(tag: &str, files: &[(&str, &str)]) -> Src {
        // One folder per call: tests running at once may build the same crate.
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "testkit-layers-{tag}-{}-{call}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, text) in files {
            let path = dir.join(path);
            std::fs::create_dir_all(path.parent().expect("parent")).expect("dir");
            std::fs::write(path, text).expect("write");
        }
        Src(dir)
    }
}

impl Drop for Src {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn paths(code: &str) -> Vec<String> {
    rooted_paths(&code_only(code))
        .into_iter()
        .map(|NamedPath { segments, glob, .. }| segments.join("::") + if glob { "::*" } else { "" })
        .collect()
}

#[test]
fn comments_and_literals_name_no_path_and_lines_keep_their_numbers() {
    let code = code_only(
        "let url = \"http://x/crate::a\"; // crate::b\n/* crate::c /* nested */ crate::d */\nlet r = r#\"crate::e \"q\"\"#; let c = '\"'; fn f<'a>(x: &'a str) { crate::f::g(x) }\n/// [`crate::h`]\nb'x'; b\"crate::i\";",
    );
    assert_eq!(paths(&code), ["crate::f::g"]);
    assert_eq!(code.lines().count(), 5);
    assert!(
        code.lines()
            .nth(2)
            .is_some_and(|l| l.contains("crate::f::g"))
    );
}

#[test]
fn use_groups_spread_into_one_path_each() {
    assert_eq!(
        paths(
            "use crate::{body::{Body, full}, errors};\nfn f() { super::super::x::y(); self::z::W::new(); }\nuse super::*;\nuse self::a::{self, b as c};"
        ),
        [
            "crate::body::Body",
            "crate::body::full",
            "crate::errors",
            "super::super::x::y",
            "self::z::W::new",
            "super::*",
            "self::a",
            "self::a::b",
        ]
    );
    let tree = rooted_paths("use self::a::{self, b as c};");
    assert_eq!(tree[1].alias.as_deref(), Some("c"));
    // Not paths: a field, `Self`, a visibility, a word that ends in `crate`.
    assert!(paths("self.x; Self::new(); pub(super) fn f() {} mycrate::x;").is_empty());
}

#[test]
fn test_modules_are_cut_out() {
    let (code, children) = without_test_modules(
        "use crate::a;\n#[cfg(test)]\nmod tests;\n#[cfg(test)]\n#[allow(dead_code)]\nmod helpers;\n#[cfg(test)]\nmod inline {\n    use crate::b;\n    fn f() { if x { } }\n}\nuse crate::c;\n",
    );
    assert_eq!(children, ["tests", "helpers"]);
    assert_eq!(paths(&code), ["crate::a", "crate::c"]);
    assert_eq!(code.lines().count(), 12);
}

#[test]
fn files_map_to_modules() {
    let m = |p: &str, lib| module_of(Path::new(p), lib);
    assert_eq!(m("lib.rs", true), Some(vec![]));
    assert_eq!(m("main.rs", true), None);
    assert_eq!(m("main.rs", false), Some(vec![]));
    assert_eq!(m("bin/tool.rs", true), None);
    assert_eq!(m("a.rs", true), Some(vec!["a".into()]));
    assert_eq!(m("a/mod.rs", true), Some(vec!["a".into()]));
    assert_eq!(m("a/b.rs", true), Some(vec!["a".into(), "b".into()]));
}

/// A crate with a circle at every kind of place the check must see one.
fn knotted() -> Src {
    Src::new(
        "knotted",
        &[
            (
                "lib.rs",
                "pub mod a;\npub mod b;\npub mod c;\npub mod d;\npub mod e;\n",
            ),
            // Root level, through `crate::` one way and `super::` the other.
            ("b.rs", "use crate::c::C;\npub struct B;\n"),
            ("c.rs", "pub struct C(super::b::B);\n"),
            // Inside a room: `a::x` and `a::y` through `super::` and `crate::a::`.
            (
                "a/mod.rs",
                "pub mod x;\npub mod y;\n#[cfg(test)]\nmod tests;\n",
            ),
            ("a/x.rs", "use super::y::Y;\npub struct X;\n"),
            (
                "a/y.rs",
                "pub struct Y;\nfn f() -> crate::a::x::X { todo!() }\n",
            ),
            // Tests and comments do not count.
            ("a/tests.rs", "use crate::b;\n"),
            (
                "e.rs",
                "// crate::d::p::P\n/// [`crate::d`]\npub struct E;\n",
            ),
            // Through the parent's re-export: `q` names `super::P`, which is `p`'s.
            (
                "d/mod.rs",
                "mod p;\nmod q;\npub use p::P;\npub(crate) use self::q::{Q as Renamed};\n",
            ),
            ("d/p.rs", "pub struct P(super::Renamed);\n"),
            ("d/q.rs", "pub struct Q(Box<super::P>);\n"),
        ],
    )
}

#[test]
fn circles_are_found_at_every_level_through_every_kind_of_path() {
    let src = knotted();
    let layers = Layers::scan(&src.0);
    assert_eq!(layers.module_count(), 10);
    let circles: Vec<String> = layers
        .circles()
        .iter()
        .map(|c| format!("{}: {}", c.module, c.members.join(" ")))
        .collect();
    assert_eq!(circles, ["crate: b c", "crate::a: x y", "crate::d: p q"]);
    let root = &layers.circles()[0];
    assert_eq!(root.steps.len(), 2);
    assert_eq!(root.steps[0].2.file, Path::new("b.rs"));
    assert_eq!(root.steps[0].2.line, 1);
    assert_eq!(root.steps[1].2.path, "super::b::B");
    // No edge from a test module or a comment.
    assert_eq!(layers.graph("crate").get("a"), None);
    assert_eq!(layers.graph("crate").get("e"), None);
}

#[test]
fn a_parents_glob_brings_siblings_into_scope() {
    let src = Src::new(
        "glob",
        &[
            ("lib.rs", "mod r;\n"),
            (
                "r/mod.rs",
                "mod s;\nmod t;\nuse self::s::Thing;\npub struct Local;\n",
            ),
            (
                "r/s.rs",
                "pub struct Thing;\nfn f() { crate::r::t::g(); }\n",
            ),
            ("r/t.rs", "use super::*;\npub fn g() -> Thing { Thing }\n"),
        ],
    );
    let layers = Layers::scan(&src.0);
    assert_eq!(
        layers.graph("crate::r"),
        [
            ("s".into(), ["t".into()].into()),
            ("t".into(), ["s".into()].into())
        ]
        .into()
    );
}

#[test]
fn allowed_circles_pass_new_and_stale_entries_fail() {
    let src = knotted();
    let layers = Layers::scan(&src.0);
    let all: &[super::Allowed<'_>] = &[
        ("crate", &["c", "b"]),
        ("crate::a", &["x", "y"]),
        ("crate::d", &["p", "q"]),
    ];
    layers.assert_no_circles(all);
    let missing = std::panic::catch_unwind(|| layers.assert_no_circles(&all[1..]))
        .expect_err("a circle not allowed fails");
    let message = missing.downcast_ref::<String>().expect("message");
    assert!(message.contains("crate: {b, c}"), "{message}");
    assert!(
        message.contains("b -> c  (b.rs:1 `crate::c::C`)"),
        "{message}"
    );
    let stale = [all, &[("crate::a", &["x", "z"][..])]].concat();
    let stale = std::panic::catch_unwind(|| layers.assert_no_circles(&stale))
        .expect_err("an entry that names no circle fails");
    let message = stale.downcast_ref::<String>().expect("message");
    assert!(message.contains("no longer found"), "{message}");
    assert!(message.contains("crate::a: {x, z}"), "{message}");
}
