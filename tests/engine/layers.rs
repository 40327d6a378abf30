//! The layering rule of both crates, read from their sources: modules are
//! listed lowest first (src/lib.rs and tools/src/lib.rs say why), and a
//! module imports only modules listed before it, by the name of the module
//! that defines what it imports (never through the crate root). So there
//! is no import cycle and no import that runs up. A crate root only
//! declares modules and re-exports; unsafe code stays in the modules that
//! talk to a driver or to C, and every other file forbids it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::common;

/// One crate, or one binary of a crate: its folder, root file, modules
/// lowest first, and the modules where unsafe code is allowed.
struct Unit {
    name: &'static str,
    dir: &'static str,
    root: &'static str,
    modules: &'static [&'static str],
    unsafe_allowed: &'static [&'static str],
}

const UNITS: &[Unit] = &[
    Unit {
        name: "tidepool",
        dir: "src",
        root: "lib.rs",
        modules: &[
            "types",
            "sync",
            "fork",
            "addr_map",
            "page_map",
            "log",
            "user_file",
            "proc_info",
            "size_class",
            "backend",
            "error",
            "tag",
            "frames",
            "pickle",
            "recording",
            "reclaim",
            "stats",
            "config",
            "registry",
            "cache_owner",
            "cache_slot",
            "heap",
            "cooperation",
            "device",
            "thread_cache",
            "allocator",
            "process",
            "snapshot",
            "buffer",
            "cudarc_interop",
            "ffi",
        ],
        unsafe_allowed: &["fork", "backend", "process", "cudarc_interop", "ffi"],
    },
    Unit { name: "tidepool-tools", dir: "tools/src", root: "lib.rs", modules: &["pickle", "trace", "exporter"], unsafe_allowed: &[] },
    Unit { name: "the tidepool command", dir: "tools/src", root: "main.rs", modules: &["cli"], unsafe_allowed: &[] },
];

/// The module a file belongs to: its first path component under the
/// crate's folder (`heap/pool.rs` is `heap`'s).
fn module_of(relative: &Path) -> String {
    relative.iter().next().map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string()).unwrap_or_default()
}

/// The path at the start of `text` (`a::b::C` of `a::b::C::new()`).
fn path_at(text: &str) -> &str {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')).next().unwrap_or("")
}

/// The items of a `{...}` group starting at `rest` (after the `{`), split
/// at the top level: `{a::{B, C}, D}` gives `a::{B, C}` and `D`.
fn group_items(rest: &str) -> Vec<String> {
    let (mut depth, mut items, mut current) = (0, Vec::new(), String::new());
    for c in rest.chars() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    items.push(current);
    items.into_iter().map(|i| i.trim().to_string()).filter(|i| !i.is_empty()).collect()
}

/// Everything `code` names after `crate::` outside comments: the first
/// segment of each path (a group counts each of its items).
fn crate_paths(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for line in code.lines() {
        let line = line.split("//").next().unwrap_or("");
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            let before = rest[..at].chars().next_back();
            rest = &rest[at + "crate::".len()..];
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$') {
                continue; // `$crate::` or part of a longer name
            }
            match rest.strip_prefix('{') {
                Some(group) => found.extend(group_items(group).iter().map(|item| first_segment(item))),
                None => {
                    found.insert(first_segment(path_at(rest)));
                }
            }
        }
    }
    found
}

fn first_segment(path: &str) -> String {
    path.split("::").next().unwrap_or("").trim().to_string()
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Each file of `unit` outside its root: (module, path, code).
fn files(unit: &Unit) -> Vec<(String, PathBuf, String)> {
    let dir = common::repo_root().join(unit.dir);
    let mut paths = Vec::new();
    sources(&dir, &mut paths);
    paths.sort();
    paths
        .into_iter()
        .filter_map(|path| {
            let module = module_of(path.strip_prefix(&dir).unwrap());
            unit.modules.contains(&module.as_str()).then(|| (module, path.clone(), std::fs::read_to_string(&path).unwrap()))
        })
        .collect()
}

/// The modules `unit`'s root declares (`mod x;`, `pub mod x;`).
fn declared(unit: &Unit) -> Vec<String> {
    let root = std::fs::read_to_string(common::repo_root().join(unit.dir).join(unit.root)).unwrap();
    root.lines()
        .map(str::trim)
        .filter_map(|line| line.strip_prefix("pub mod ").or_else(|| line.strip_prefix("mod ")))
        .map(|rest| rest.trim_end_matches(';').trim().to_string())
        .collect()
}

#[test]
fn every_import_points_to_a_module_listed_before_it_and_none_goes_through_the_root() {
    let mut wrong = Vec::new();
    for unit in UNITS {
        let rank = |module: &str| unit.modules.iter().position(|m| *m == module);
        for (module, path, code) in files(unit) {
            let at = rank(&module).unwrap();
            for name in crate_paths(&code) {
                match rank(&name) {
                    Some(dep) if dep > at => wrong.push(format!("{}: {module} imports {name}, listed after it", path.display())),
                    Some(_) => {}
                    None => {
                        wrong.push(format!("{}: crate::{name} is not a module of {}: import it from its module", path.display(), unit.name))
                    }
                }
            }
        }
    }
    assert!(wrong.is_empty(), "imports against the layering rule:\n{}", wrong.join("\n"));
}

#[test]
fn each_root_declares_exactly_its_listed_modules_and_holds_nothing_else() {
    for unit in UNITS {
        let mut listed: Vec<String> = unit.modules.iter().map(|m| m.to_string()).collect();
        let mut found = declared(unit);
        listed.sort();
        found.sort();
        assert_eq!(found, listed, "{}: the modules {} declares and the list here differ", unit.name, unit.root);
    }
    // The library roots: declarations, re-exports and documentation only.
    for unit in UNITS.iter().filter(|u| u.root == "lib.rs") {
        let root = std::fs::read_to_string(common::repo_root().join(unit.dir).join(unit.root)).unwrap();
        let allowed = ["//", "#[", "#![", "pub mod ", "mod ", "pub use ", "}", ""];
        let mut in_use_group = false;
        for line in root.lines().map(str::trim) {
            if in_use_group {
                in_use_group = !line.ends_with("};");
                continue;
            }
            if line.starts_with("pub use ") && line.ends_with('{') {
                in_use_group = true;
            }
            assert!(
                allowed.iter().any(|a| if a.is_empty() { line.is_empty() } else { line.starts_with(a) }),
                "{}: {line:?} in the crate root",
                unit.name
            );
        }
    }
}

#[test]
fn unsafe_code_stays_in_the_driver_and_c_modules() {
    for unit in UNITS {
        // A module's own file (`x.rs` or `x/mod.rs`) forbids it for its whole folder.
        let module_file =
            |path: &Path| path.file_name().is_some_and(|n| n == "mod.rs") || path.parent().is_some_and(|p| p.ends_with(unit.dir));
        for (module, path, code) in files(unit).into_iter().filter(|(_, path, _)| module_file(path)) {
            if !unit.unsafe_allowed.contains(&module.as_str()) {
                assert!(code.contains("#![forbid(unsafe_code)]"), "{} ({module}) does not forbid unsafe code", path.display());
            }
        }
    }
}

#[test]
fn imports_are_read_by_module_and_outside_comments() {
    let set = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<BTreeSet<String>>();
    assert_eq!(crate_paths("use crate::heap::DeviceHeap; // crate::trace"), set(&["heap"]));
    assert_eq!(crate_paths("use crate::reclaim::policy::Reason;"), set(&["reclaim"]));
    assert_eq!(crate_paths("use crate::{Allocator, Stream};"), set(&["Allocator", "Stream"]));
    assert_eq!(crate_paths("use crate::{trace::{Trace, Event}, stats};"), set(&["trace", "stats"]));
    assert_eq!(crate_paths("$crate::ffi::boundary::set_last_error(x)"), set(&[]));
    assert_eq!(module_of(Path::new("heap/release.rs")), "heap");
    assert_eq!(module_of(Path::new("registry/scan.rs")), "registry");
}
