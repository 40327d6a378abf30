//! ffi/tidepool.h must say what src/ffi/ does: the same functions with
//! the same C types, the same structs field by field, the same constants;
//! and the library must export exactly those functions.

use crate::common;

use std::collections::BTreeMap;
use std::process::Command;

fn read(path: &str) -> String {
    std::fs::read_to_string(common::repo_root().join(path)).unwrap()
}

/// Rust FFI types in C spelling.
/// The C ABI's Rust sources (src/ffi/), one text.
fn ffi_sources() -> String {
    let dir = common::repo_root().join("src/ffi");
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    files.iter().map(|f| std::fs::read_to_string(f).unwrap()).collect::<Vec<_>>().join("\n")
}

fn c_type(rust: &str) -> String {
    let rust = rust.trim();
    match rust {
        "usize" => "size_t".into(),
        "c_int" => "int".into(),
        "f64" => "double".into(),
        "u64" => "uint64_t".into(),
        "u32" => "uint32_t".into(),
        "i64" => "int64_t".into(),
        "" | "()" => "void".into(),
        _ => {
            if let Some(inner) = rust.strip_prefix("*mut ") {
                return format!("{}*", c_type(inner));
            }
            if let Some(inner) = rust.strip_prefix("*const ") {
                return format!("const {}*", c_type(inner));
            }
            match rust {
                "c_void" => "void".into(),
                "c_char" => "char".into(),
                other => other.to_string(),
            }
        }
    }
}

fn squash(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ").replace(" *", "*")
}

/// name -> "ret(param types)" from the header's prototypes.
fn header_functions(header: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in header.lines().map(str::trim) {
        let prototype = line.ends_with(");") && !line.starts_with("/*") && !line.starts_with("typedef");
        let Some(open) = line.find("tidepool_").filter(|_| prototype) else { continue };
        let (ret, rest) = line.split_at(open);
        let (name, params) = rest.split_once('(').unwrap();
        let params = params.trim_end_matches(");");
        let types: Vec<String> = if params.trim() == "void" {
            vec![]
        } else {
            // Drop each parameter's name: the last identifier.
            params
                .split(',')
                .map(|p| {
                    let p = p.trim();
                    let cut = p.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
                    squash(&p[..cut])
                })
                .collect()
        };
        out.insert(name.to_string(), format!("{}({})", squash(ret), types.join(", ")));
    }
    out
}

/// name -> "ret(param types)" from the Rust exports.
fn rust_functions(source: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in source.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("pub extern \"C\" fn ") else { continue };
        let (name, rest) = rest.split_once('(').unwrap();
        let (params, rest) = rest.split_once(')').unwrap();
        let ret = rest.trim().strip_prefix("->").map(|r| r.trim_end_matches('{').trim()).unwrap_or("");
        let types: Vec<String> = params.split(',').filter(|p| !p.trim().is_empty()).map(|p| c_type(p.split_once(':').unwrap().1)).collect();
        out.insert(name.to_string(), format!("{}({})", c_type(ret), types.join(", ")));
    }
    out
}

/// struct name -> ["type name", ...] from the header's typedefs.
fn header_structs(header: &str) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    let mut current: Option<(String, Vec<String>)> = None;
    for line in header.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("typedef struct ") {
            current = Some((rest.trim_end_matches(" {").to_string(), vec![]));
        } else if line.starts_with('}') {
            if let Some((name, fields)) = current.take() {
                out.insert(name, fields);
            }
        } else if let Some((_, fields)) = current.as_mut() {
            if let Some(decl) = line.split(';').next().filter(|_| line.contains(';')) {
                fields.push(squash(decl));
            }
        }
    }
    out
}

/// struct name -> ["type name", ...] from the Rust repr(C) structs.
fn rust_structs(source: &str) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    let mut current: Option<(String, Vec<String>)> = None;
    for line in source.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("pub struct tidepool_") {
            current = Some((format!("tidepool_{}", rest.trim_end_matches(" {")), vec![]));
        } else if line == "}" {
            if let Some((name, fields)) = current.take() {
                out.insert(name, fields);
            }
        } else if let Some((_, fields)) = current.as_mut() {
            if let Some(field) = line.strip_prefix("pub ") {
                let (name, ty) = field.trim_end_matches(',').split_once(':').unwrap();
                let ty = ty.trim();
                let decl = match ty.strip_prefix('[').and_then(|t| t.strip_suffix(']')) {
                    Some(array) => {
                        let (elem, n) = array.split_once(';').unwrap();
                        format!("{} {}[{}]", c_type(elem), name.trim(), n.trim())
                    }
                    None => format!("{} {}", c_type(ty), name.trim()),
                };
                fields.push(decl);
            }
        }
    }
    out
}

fn header_constants(header: &str) -> BTreeMap<String, String> {
    header
        .lines()
        .filter_map(|l| l.trim().strip_prefix("#define TIDEPOOL_"))
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            Some((format!("TIDEPOOL_{}", parts.next()?), parts.next()?.to_string()))
        })
        .collect()
}

fn rust_constants(source: &str) -> BTreeMap<String, String> {
    source
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub const TIDEPOOL_"))
        .map(|l| {
            let (name, value) = l.split_once(':').unwrap();
            let value = value.split('=').nth(1).unwrap().trim().trim_end_matches(';');
            (format!("TIDEPOOL_{name}"), value.to_string())
        })
        .collect()
}

#[test]
fn the_header_declares_exactly_the_rust_exports() {
    let (header, source) = (read("ffi/tidepool.h"), ffi_sources());
    let declared = header_functions(&header);
    assert_eq!(declared.len(), 25, "{declared:#?}");
    assert_eq!(declared, rust_functions(&source));
    assert_eq!(declared["tidepool_malloc"], "void*(size_t, int, void*)");
    // PyTorch calls these as void(int, MempoolId_t, std::function<...>):
    // the pair by value in two registers, the std::function by address.
    assert_eq!(declared["tidepool_begin_allocate_to_pool"], "void(int, uint64_t, uint64_t, void*)");
    assert_eq!(declared["tidepool_dump_snapshot"], "int(const char*)");
    assert_eq!(declared["tidepool_malloc_with_context"], "void*(size_t, int, void*, uint64_t)");
    assert_eq!(declared["tidepool_register_context"], "int(uint64_t, const tidepool_frame*, size_t)");
    assert_eq!(declared["tidepool_attach_oom_observer"], "int(tidepool_oom_observer, void*)");
    // The tag calls, named as other runtimes bind them.
    assert_eq!(declared["tidepool_set_tag"], "int(const char*)");
    assert_eq!(declared["tidepool_pause"], "int(const char*, int, int)");
    assert_eq!(declared["tidepool_resume"], "int(const char*, int)");
    assert_eq!(declared["tidepool_get_tag_stats"], "int(const char*, int, tidepool_tag_stats*)");
}

/// The parameter types of the function-pointer typedef `name` in the header
/// and of the Rust type alias of the same name.
fn callback_types(header: &str, source: &str, name: &str) -> (String, String) {
    let c_line = header.lines().find(|l| l.starts_with("typedef") && l.contains(&format!("(*{name})"))).unwrap();
    let c_params = c_line.rsplit_once(")(").unwrap().1.trim_end_matches(");");
    let c_types: Vec<String> = c_params
        .split(',')
        .map(|p| {
            let p = p.trim();
            let cut = p.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
            squash(&p[..cut])
        })
        .collect();
    let rust = source.split(&format!("pub type {name} =")).nth(1).unwrap();
    let rust_params = rust.split_once("fn(").unwrap().1.split_once(")>").unwrap().0;
    let rust_types: Vec<String> = rust_params.split(',').map(|p| c_type(p.split_once(':').unwrap().1)).collect();
    (c_types.join(", "), rust_types.join(", "))
}

#[test]
fn the_oom_observer_typedef_matches_the_rust_type() {
    let (header, source) = (read("ffi/tidepool.h"), ffi_sources());
    let (c, rust) = callback_types(&header, &source, "tidepool_oom_observer");
    assert_eq!(c, "int, size_t, size_t, size_t, void*");
    assert_eq!(c, rust);
    assert!(header.contains("typedef void (*tidepool_oom_observer)("), "the observer returns void");
}

#[test]
fn the_header_structs_match_the_rust_structs_field_by_field() {
    let (header, source) = (read("ffi/tidepool.h"), ffi_sources());
    let declared = header_structs(&header);
    assert_eq!(
        declared.keys().collect::<Vec<_>>(),
        ["tidepool_frame", "tidepool_stat", "tidepool_stat_by_pool", "tidepool_stats", "tidepool_tag_stats"]
    );
    assert_eq!(declared, rust_structs(&source));
}

#[test]
fn the_header_constants_match_the_rust_constants() {
    let (header, source) = (read("ffi/tidepool.h"), ffi_sources());
    assert_eq!(header_constants(&header), rust_constants(&source));
}

#[test]
fn the_library_exports_exactly_the_declared_functions() {
    let lib = common::cdylib();
    let Some(nm) = common::tool("nm", "apt-get install binutils") else { return };
    let output = Command::new(nm).args(["-D", "--defined-only"]).arg(&lib).output().expect("nm runs");
    let text = String::from_utf8_lossy(&output.stdout);
    let exported: Vec<&str> = text.lines().filter_map(|l| l.split_whitespace().last()).filter(|s| s.starts_with("tidepool_")).collect();
    let declared: Vec<String> = header_functions(&read("ffi/tidepool.h")).into_keys().collect();
    assert_eq!(exported, declared);
}

// One list of counters and gauges: the library's (`Events::COUNTERS` and
// `Stats::GAUGES`, generated in src/stats.rs from the list that also makes
// the Rust struct, its sum and the PyTorch-style keys) must be in the C
// struct of the header and in the Python package, each counter under the
// same key and field.

const PYTHON: &str = "ffi/python/tidepool/_native.py";

/// The quoted strings of `text`, in order.
fn quoted(text: &str) -> Vec<String> {
    text.split('"').skip(1).step_by(2).map(str::to_string).collect()
}

/// The lines of a top-level Python statement starting with `start`, up to
/// the next top-level line (a `)`, or the next definition).
fn python_block<'a>(source: &'a str, start: &str) -> &'a str {
    let from = source.find(&format!("\n{start}")).unwrap_or_else(|| panic!("{PYTHON} has no `{start}`")) + 1;
    let rest = &source[from..];
    let mut end = rest.find('\n').map_or(rest.len(), |i| i + 1);
    for line in rest[end..].split_inclusive('\n') {
        if !line.starts_with([' ', '\n', ')', ']']) {
            break;
        }
        end += line.len();
    }
    &rest[..end]
}

/// The field names of `tidepool_stats` in the header, in order (an array's
/// without its length).
fn header_stats_fields(header: &str) -> Vec<String> {
    header_structs(header)["tidepool_stats"]
        .iter()
        .map(|decl| decl.rsplit(' ').next().unwrap().split('[').next().unwrap().to_string())
        .collect()
}

#[test]
fn every_counter_is_in_the_c_struct_the_header_and_the_python_key_list() {
    let (header, python) = (read("ffi/tidepool.h"), read(PYTHON));
    let c_decls = &header_structs(&header)["tidepool_stats"];
    let python_fields = quoted(python_block(&python, "class Stats("));
    for counter in tidepool::Events::COUNTERS {
        let decl = format!("uint64_t {}", counter.c_field);
        assert!(c_decls.contains(&decl), "ffi/tidepool.h: tidepool_stats has no `{decl}` for {counter:?}");
        assert!(python_fields.contains(&counter.c_field.to_string()), "{PYTHON}: Stats has no field {}", counter.c_field);
    }
    // (The Rust struct tidepool_stats is the header's, by the test above,
    // and src/ffi/stats.rs fills it from the list: a counter without a field
    // there does not compile.)
    let listed = quoted(python_block(&python, "COUNTERS = ("));
    let pairs: Vec<(String, String)> = listed.chunks(2).map(|pair| (pair[0].clone(), pair[1].clone())).collect();
    let expected: Vec<(String, String)> = tidepool::Events::COUNTERS.iter().map(|c| (c.key.to_string(), c.c_field.to_string())).collect();
    assert_eq!(pairs, expected, "{PYTHON}: COUNTERS (memory_stats key, tidepool_stats field) differ from the library's list");
}

#[test]
fn the_python_ctypes_struct_mirrors_the_header_field_by_field() {
    let (header, python) = (read("ffi/tidepool.h"), read(PYTHON));
    assert_eq!(quoted(python_block(&python, "class Stats(")), header_stats_fields(&header), "{PYTHON}: Stats");
    let version = |text: &str, prefix: &str| text.lines().find_map(|l| l.strip_prefix(prefix)).map(|v| v.trim().to_string()).unwrap();
    assert_eq!(version(&python, "STATS_VERSION = "), version(&header, "#define TIDEPOOL_STATS_VERSION "));
}

#[test]
fn every_gauge_and_release_reason_is_in_the_header_and_python_in_order() {
    let (header, python) = (read("ffi/tidepool.h"), read(PYTHON));
    let gauges: Vec<String> = tidepool::Stats::GAUGES.iter().map(|g| g.to_string()).collect();
    let decl = format!("tidepool_stat_by_pool gauges[{}]", gauges.len());
    assert!(header_structs(&header)["tidepool_stats"].contains(&decl), "ffi/tidepool.h: no `{decl}`");
    // The header names them in its comment above the array.
    let order = header.split("gauges, in this order:").nth(1).expect("the header lists the gauges' order");
    let order: Vec<String> = order.split('.').next().unwrap().replace('*', " ").split(',').map(|g| g.trim().to_string()).collect();
    assert_eq!(order, gauges, "ffi/tidepool.h: the gauges' order");
    assert_eq!(quoted(python_block(&python, "GAUGES = (")), gauges, "{PYTHON}: GAUGES");
    // Memory given back, by why: tidepool.released_bytes.<reason>.
    let reasons: Vec<String> = tidepool::Stats::default()
        .to_pytorch_keys()
        .into_iter()
        .filter_map(|(key, _)| key.strip_prefix("tidepool.released_bytes.").map(str::to_string))
        .collect();
    assert_eq!(reasons.len(), 6);
    assert_eq!(quoted(python_block(&python, "RELEASE_REASONS = (")), reasons, "{PYTHON}: RELEASE_REASONS");
    let fields = header_stats_fields(&header);
    for reason in &reasons {
        assert!(fields.contains(&format!("released_{reason}_bytes")), "ffi/tidepool.h: no released_{reason}_bytes");
    }
}
