//! The layering rule (src/lib.rs): a module imports only from its own
//! layer or below, and modules import each other in no cycle. Read from
//! the sources: every `crate::module` a file names outside comments.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each module's layer, lowest first (the list in src/lib.rs). `lib` is the
/// crate root: the `Allocator` face, which declares and re-exports every
/// module (so it takes no part in the cycle check).
const LAYERS: &[(&str, &[&str])] = &[
    (
        "below",
        &[
            "backend",
            "size_class",
            "reclaim",
            "reclaim::policy",
            "reclaim::registry",
            "stats",
            "types",
            "tag",
            "error",
            "frames",
            "pickle",
            "recording",
            "config",
            "log",
        ],
    ),
    ("heap", &["heap"]),
    ("device", &["device", "cooperation"]),
    ("faces", &["lib", "buffer", "ffi", "cudarc_interop", "snapshot"]),
    ("tools", &["trace", "exporter"]),
];

fn layer_of(module: &str) -> usize {
    LAYERS
        .iter()
        .position(|(_, modules)| modules.contains(&module))
        .unwrap_or_else(|| panic!("module {module} is in no layer: add it to LAYERS and to the list in src/lib.rs"))
}

/// The module a path under src/ belongs to: its top-level module, except
/// that reclaim's files are modules of their own (the thread, the pure
/// policy and the shared registry).
fn module_of(relative: &Path) -> String {
    let parts: Vec<String> = relative.iter().map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string()).collect();
    match parts.as_slice() {
        [reclaim, child] if reclaim == "reclaim" && child != "mod" => format!("reclaim::{child}"),
        [first, ..] => first.clone(),
        [] => unreachable!(),
    }
}

/// The module a path inside the crate starts with: `reclaim`'s files count
/// as modules of their own, and a name that is not a module (a type or
/// function the crate root re-exports) is the crate root's.
fn module_named(path: &str) -> String {
    let mut segments = path.split("::").map(|s| s.trim());
    let first = segments.next().unwrap_or("");
    match first {
        "reclaim" => match segments.next() {
            Some(child @ ("policy" | "registry")) => format!("reclaim::{child}"),
            _ => "reclaim".into(),
        },
        "" | "self" | "super" | "global" => "lib".into(),
        name if name.starts_with(|c: char| c.is_ascii_uppercase()) => "lib".into(),
        name => name.into(),
    }
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

/// The modules `code` names with `crate::` (a group counts each of its
/// items), outside comments; in the crate root (`root`), also the modules
/// it names by their bare names (`device::Device`).
fn imports(code: &str, root: bool) -> BTreeSet<String> {
    let known: Vec<&str> =
        LAYERS.iter().flat_map(|(_, modules)| modules.iter().copied()).filter(|m| *m != "lib" && !m.contains("::")).collect();
    let mut found = BTreeSet::new();
    for line in code.lines() {
        let line = line.split("//").next().unwrap_or("");
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            match rest.strip_prefix('{') {
                Some(group) => found.extend(group_items(group).iter().map(|item| module_named(item))),
                None => {
                    found.insert(module_named(path_at(rest)));
                }
            }
        }
        let declaration = line.trim_start().starts_with("mod ") || line.trim_start().starts_with("pub mod ");
        if root && !declaration {
            for name in &known {
                let bare = line
                    .match_indices(&format!("{name}::"))
                    .any(|(at, _)| line[..at].chars().next_back().is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')));
                if bare {
                    found.insert(module_named(path_at(&line[line.find(&format!("{name}::")).unwrap()..])));
                }
            }
        }
    }
    found
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

/// Module -> the modules it imports, over every file of the library
/// (src/bin is a separate crate that uses the library's public API).
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let relative = file.strip_prefix(&src).unwrap();
        if relative.starts_with("bin") {
            continue;
        }
        let module = module_of(relative);
        let code = std::fs::read_to_string(&file).unwrap();
        let deps = graph.entry(module.clone()).or_default();
        deps.extend(imports(&code, module == "lib").into_iter().filter(|d| *d != module));
    }
    graph
}

#[test]
fn every_import_points_to_the_same_layer_or_below() {
    let mut upward = Vec::new();
    for (module, deps) in graph() {
        for dep in deps {
            if layer_of(&dep) > layer_of(&module) {
                upward.push(format!("{module} ({}) imports {dep} ({})", LAYERS[layer_of(&module)].0, LAYERS[layer_of(&dep)].0));
            }
        }
    }
    assert!(upward.is_empty(), "imports that point up:\n{}", upward.join("\n"));
}

#[test]
fn modules_import_each_other_in_no_cycle() {
    let graph = graph();
    // Depth-first search for a back edge, the crate root left out.
    fn visit<'a>(
        module: &'a str,
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) -> Option<String> {
        if let Some(at) = path.iter().position(|m| *m == module) {
            return Some(format!("{} -> {module}", path[at..].join(" -> ")));
        }
        if !done.insert(module) {
            return None;
        }
        path.push(module);
        for dep in graph.get(module).into_iter().flatten().filter(|d| *d != "lib") {
            if let Some(cycle) = visit(dep, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    for module in graph.keys().filter(|m| *m != "lib") {
        if let Some(cycle) = visit(module, &graph, &mut Vec::new(), &mut done) {
            panic!("an import cycle: {cycle}");
        }
    }
}

#[test]
fn imports_are_read_by_module_and_outside_comments() {
    let set = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<BTreeSet<String>>();
    assert_eq!(imports("use crate::heap::DeviceHeap; // crate::trace", false), set(&["heap"]));
    assert_eq!(imports("use crate::reclaim::policy::Reason;", false), set(&["reclaim::policy"]));
    assert_eq!(imports("use crate::{Allocator, Stream};", false), set(&["lib"]));
    assert_eq!(imports("use crate::{trace::{Trace, Event}, Allocator};", false), set(&["trace", "lib"]));
    assert_eq!(imports("let d = device::Device::new(); pub mod trace;", true), set(&["device"]));
    assert_eq!(imports("let d = device::Device::new();", false), set(&[]));
    assert!(layer_of("trace") > layer_of("heap"));
    assert_eq!(module_of(Path::new("heap/release.rs")), "heap");
    assert_eq!(module_of(Path::new("reclaim/registry.rs")), "reclaim::registry");
}
