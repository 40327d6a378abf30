//! The documentation's commands run and print what it shows, and its links
//! lead somewhere: README.md and every page of docs/.
//!
//! The convention (README.md's first comment says it to its editors):
//! - a block fenced ```sh holds commands this test runs, one a line (a line
//!   ending in `\` goes on), from the repository's root with this build's
//!   `tidepool` first on PATH. Each must exit 0, and the ```text block right
//!   after it, when there is one, is what the block prints on stdout: runs
//!   of spaces and line breaks compare as one space, a line `...` stands
//!   for any lines, and replay speeds (the `replay speed` row) are not
//!   compared. Commands that start with `python` run with the Python of
//!   TIDEPOOL_TEST_PYTHON (else python3) over ffi/python, this build's
//!   library and command; where it lacks torch, transformers or numpy they
//!   are skipped with a message (under CI=true that fails). An output that
//!   names another torch than the test's is only run, not compared
//!   (under CI=true, with the pinned torch, that fails too).
//! - a block fenced ```shell holds commands shown and not run here (pip, a
//!   GPU, minutes, servers that run until stopped): each must start as one
//!   of `COVERED`, which says what runs it (a test, or ./test.sh).
//! - README's ```c block is a whole program, compiled against this build's
//!   library and run on the host backend; the ```text block after its
//!   build commands is what it prints. README's ```rust block is the body
//!   of `rust_quick_start` below, line for line.
//! - every fenced block says its language; every relative link names a
//!   file that exists and every `#anchor` a heading of its page.
//!
//! docs/configuration.md is generated (docs.rs checks it): its blocks are
//! left alone, its links checked.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::common;

/// Commands of ```shell blocks (the start of each), with what runs them.
/// A command shown in a ```shell block that starts as none of these fails
/// `every_command_not_run_here_is_run_elsewhere`.
const COVERED: &[(&str, &str)] = &[
    // Install (README, docs/pytorch.md).
    ("python3 -m venv ~/tidepool-venv", "python::the_wheel_installs_into_a_fresh_venv_without_rust_and_reads_statistics (a fresh venv)"),
    (
        ". ~/tidepool-venv/bin/activate",
        "python::the_wheel_installs_into_a_fresh_venv_without_rust_and_reads_statistics (runs the venv's tidepool)",
    ),
    ("pip install torch transformers", "./test.sh (installs torch 2.15.0 and transformers into the tests' venv)"),
    (
        "pip install ./ffi/python",
        "python::the_wheel_installs_into_a_fresh_venv_without_rust_and_reads_statistics (pip wheel ./ffi/python, installed)",
    ),
    // Building the C library (README's C quick start, docs/cabi.md).
    (
        "cargo build --release -p tidepool",
        "python::the_wheel_is_a_platform_wheel_holding_its_libraries (pip wheel runs cargo build --release of the crate)",
    ),
    ("cc quick_start.c -I ffi -L target/release -ltidepool", "readme::the_c_quick_start_compiles_and_prints_what_the_readme_shows"),
    (
        "cc my_runtime.c -I ffi -L target/release -ltidepool",
        "readme::the_c_quick_start_compiles_and_prints_what_the_readme_shows (the same flags)",
    ),
    ("TIDEPOOL_CONF=backend:host ./quick_start", "readme::the_c_quick_start_compiles_and_prints_what_the_readme_shows"),
    // Commands that run until stopped (docs/monitoring.md).
    ("tidepool top", "top::* (the table and JSON of live processes)"),
    ("tidepool exporter", "exporter::* (served to a real Prometheus; --textfile and --once)"),
    // Tests and their environment (docs/testing.md): what ./test.sh does.
    ("./test.sh", "CI (.ci/run runs exactly this, on a fresh clone)"),
    ("cargo test --locked", "./test.sh (cargo test --locked runs every test, filters included)"),
    ("python3 -m venv ~/.cache/tidepool-ci/venv-torch-2.15.0", "./test.sh (makes this venv)"),
    ("~/.cache/tidepool-ci/venv-torch-2.15.0/bin/pip install", "./test.sh (installs these packages into it)"),
    ("TIDEPOOL_TEST_PYTHON=~/.cache/tidepool-ci/venv-torch-2.15.0/bin/python cargo test --locked", "./test.sh"),
    ("TIDEPOOL_SOAK_SECS=600 cargo test --locked --test processes -- soak::", "./test.sh (the soak, 30 s under CI=true)"),
    // The GPU check (docs/testing.md#on-a-gpu): staged and rehearsed by ./test.sh.
    ("cuda/check/prepare.sh", "./test.sh (stages the GPU check; gpu_check::* checks its size check)"),
    ("bash cuda/check/run.sh --rehearse", "./test.sh (the rehearsal over simgpu, after prepare.sh)"),
    ("bash cuda/check/run.sh", "./test.sh (rehearsed with --rehearse; on a GPU only by hand, see docs/gpu-results.md)"),
];

/// README.md and every page of docs/, as (path from the root, text).
fn pages() -> Vec<(PathBuf, String)> {
    let root = common::repo_root();
    let mut paths = vec![PathBuf::from("README.md")];
    let mut stack = vec![PathBuf::from("docs")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(root.join(&dir)).unwrap() {
            let path = dir.join(entry.unwrap().file_name());
            if root.join(&path).is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                paths.push(path);
            }
        }
    }
    paths.sort();
    paths.into_iter().map(|p| (p.clone(), std::fs::read_to_string(root.join(&p)).unwrap())).collect()
}

/// The generated page, whose blocks are the options table's to choose.
fn generated(page: &Path) -> bool {
    page == Path::new("docs/configuration.md")
}

/// A fenced block: its language (the info string's first word), its
/// lines, and the line it starts on.
struct Block {
    lang: String,
    body: String,
    line: usize,
}

fn blocks(text: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<(String, String, usize, usize)> = None; // lang, body, line, indent
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        match &mut open {
            None if trimmed.starts_with("```") => {
                let lang = trimmed.trim_start_matches('`').split_whitespace().next().unwrap_or("").to_string();
                open = Some((lang, String::new(), n + 1, indent));
            }
            Some((lang, body, start, _)) if trimmed.starts_with("```") => {
                out.push(Block { lang: std::mem::take(lang), body: std::mem::take(body), line: *start });
                open = None;
            }
            Some((_, body, _, indent)) => {
                body.push_str(line.get(*indent..).unwrap_or(line.trim_start()));
                body.push('\n');
            }
            None => {}
        }
    }
    assert!(open.is_none(), "a fenced block is not closed");
    out
}

/// The commands of a shell block: continuation lines joined, comments and
/// blank lines dropped.
fn commands(body: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in body.lines() {
        let line = line.trim();
        if let Some(head) = line.strip_suffix('\\') {
            current.push_str(head.trim_end());
            current.push(' ');
            continue;
        }
        current.push_str(line);
        let command = strip_comment(&current).trim().to_string();
        current.clear();
        if !command.is_empty() {
            out.push(command);
        }
    }
    out
}

/// A command without its trailing `# comment` (a `#` after a space,
/// outside quotes).
fn strip_comment(command: &str) -> &str {
    let (mut single, mut double, mut previous) = (false, false, ' ');
    for (at, c) in command.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && previous.is_whitespace() => return &command[..at],
            _ => {}
        }
        previous = c;
    }
    command
}

/// Text as compared: replay-speed rows out, every run of whitespace one space.
fn normalized(text: &str) -> String {
    let kept: Vec<&str> = text.lines().filter(|l| !l.trim_start().starts_with("replay speed")).collect();
    kept.join("\n").split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Whether `actual` is what `expected` shows, a line `...` standing for
/// any lines.
fn shows(expected: &str, actual: &str) -> bool {
    let parts: Vec<String> = expected.split("\n...\n").map(normalized).collect();
    let actual = normalized(actual);
    if parts.len() == 1 {
        return parts[0] == actual;
    }
    let (first, last) = (&parts[0], &parts[parts.len() - 1]);
    if !actual.starts_with(first.as_str()) || !actual.ends_with(last.as_str()) {
        return false;
    }
    let mut rest = &actual[first.len()..actual.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part.as_str()) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

/// The test's Python, when it has what the documentation's `python`
/// commands need; None (and a message, or a failure under CI=true) when not.
fn python() -> Option<&'static PathBuf> {
    static PYTHON: OnceLock<Option<PathBuf>> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let python = std::env::var_os("TIDEPOOL_TEST_PYTHON").map_or_else(|| PathBuf::from("python3"), PathBuf::from);
            let ok = Command::new(&python).args(["-c", "import torch, transformers, numpy"]).output().is_ok_and(|o| o.status.success());
            if ok {
                return Some(python);
            }
            let why = format!("{} cannot import torch, transformers and numpy (set TIDEPOOL_TEST_PYTHON)", python.display());
            assert!(!common::in_ci(), "{why}: the documentation's python commands need them under CI=true");
            eprintln!("{why}: the documentation's python commands are skipped");
            None
        })
        .as_ref()
}

/// A folder whose `python` runs the test's Python, for PATH (a script,
/// not a link: a venv's Python finds its venv by the path it is run as).
fn python_dir(python: &Path) -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        use std::os::unix::fs::PermissionsExt;
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("readme-python");
        std::fs::create_dir_all(&dir).unwrap();
        let target = if python.components().count() > 1 { python.to_path_buf() } else { which(python) };
        let script = dir.join("python");
        std::fs::write(&script, format!("#!/bin/sh\nexec '{}' \"$@\"\n", target.display())).unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        dir
    })
    .clone()
}

/// The folder the documentation's commands keep their registries in
/// (XDG_RUNTIME_DIR), so that they join neither the user's nor those of
/// the tests' child processes.
fn runtime_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("readme-runtime");
        std::fs::create_dir_all(&dir).unwrap();
        dir
    })
}

/// `name` found on PATH.
fn which(name: &Path) -> PathBuf {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{} is not on PATH", name.display()))
}

/// Runs one command of a ```sh block as a user would, from the root with
/// this build's tidepool (and cargo, and for `python` the test's Python
/// over ffi/python) first on PATH; returns its stdout.
fn run(page: &Path, command: &str, python: Option<&Path>) -> String {
    let tidepool = Path::new(env!("CARGO_BIN_EXE_tidepool"));
    let mut path = vec![tidepool.parent().unwrap().to_path_buf(), Path::new(env!("CARGO")).parent().unwrap().to_path_buf()];
    let mut sh = Command::new("sh");
    common::contained(&mut sh); // TMPDIR; the registries go to a folder of their own, below
    sh.args(["-c", command])
        .current_dir(common::repo_root())
        .env_remove("TIDEPOOL_CONF")
        .env_remove("TIDEPOOL_TRACE")
        .env("XDG_RUNTIME_DIR", runtime_dir());
    if let Some(python) = python {
        path.insert(0, python_dir(python));
        sh.env("PYTHONPATH", common::repo_root().join("ffi/python"))
            .env("TIDEPOOL_BIN", tidepool)
            .env("TIDEPOOL_LIBRARY", common::cdylib());
    }
    path.extend(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()));
    sh.env("PATH", std::env::join_paths(path).unwrap());
    let out = sh.output().unwrap_or_else(|err| panic!("cannot run sh: {err}"));
    assert!(
        out.status.success(),
        "{}: `{command}` failed ({}):\n{}{}",
        page.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The torch version an output names ("... with torch 2.15.0+cu132").
fn torch_named(text: &str) -> Option<&str> {
    text.split_once("with torch ").and_then(|(_, rest)| rest.split_whitespace().next())
}

/// Runs every ```sh block of the pages and compares what each prints with
/// the ```text block after it.
fn check_sh_blocks(pages: &[(PathBuf, String)]) {
    let mut ran = 0;
    for (page, text) in pages.iter().filter(|(p, _)| !generated(p)) {
        let all = blocks(text);
        for (i, block) in all.iter().enumerate().filter(|(_, b)| b.lang == "sh") {
            let commands = commands(&block.body);
            assert!(!commands.is_empty(), "{}:{}: an empty sh block", page.display(), block.line);
            let needs_python = commands.iter().any(|c| c.starts_with("python"));
            let python = if needs_python {
                match python() {
                    Some(p) => Some(p.as_path()),
                    None => continue,
                }
            } else {
                None
            };
            let started = std::time::Instant::now();
            let printed: String = commands.iter().map(|c| run(page, c, python)).collect();
            eprintln!("{}:{}: {} command(s) in {:.1?}", page.display(), block.line, commands.len(), started.elapsed());
            ran += 1;
            // The text block right after, if any, is what it prints.
            let Some(expected) = all.get(i + 1).filter(|next| next.lang == "text" && right_after(text, block, next)) else { continue };
            if let (Some(shown), Some(got)) = (torch_named(&expected.body), torch_named(&printed)) {
                if shown != got {
                    let why = format!("{}:{}: the output shown is of torch {shown}, this Python has {got}", page.display(), block.line);
                    assert!(!common::in_ci(), "{why}");
                    eprintln!("{why}: not compared");
                    continue;
                }
            }
            assert!(
                shows(&expected.body, &printed),
                "{}:{}: `{}` printed\n{printed}\nwhere the page shows\n{}",
                page.display(),
                block.line,
                commands.join("; "),
                expected.body
            );
        }
    }
    assert!(ran > 0, "no sh block ran");
}

/// Whether `next` follows `block` with nothing but blank lines between.
fn right_after(text: &str, block: &Block, next: &Block) -> bool {
    let lines: Vec<&str> = text.lines().collect();
    let end = block.line + block.body.lines().count() + 1; // the closing fence, 1-based line `end`
    lines[end..next.line - 1].iter().all(|l| l.trim().is_empty())
}

#[test]
fn the_readme_commands_run_and_print_what_the_readme_shows() {
    let pages: Vec<_> = pages().into_iter().filter(|(p, _)| p == Path::new("README.md")).collect();
    check_sh_blocks(&pages);
}

#[test]
fn the_docs_commands_run_and_print_what_the_pages_show() {
    let pages: Vec<_> = pages().into_iter().filter(|(p, _)| p != Path::new("README.md")).collect();
    check_sh_blocks(&pages);
}

#[test]
fn every_command_not_run_here_is_run_elsewhere() {
    let mut unlisted = Vec::new();
    for (page, text) in pages().iter().filter(|(p, _)| !generated(p)) {
        for block in blocks(text).iter().filter(|b| b.lang == "shell") {
            for command in commands(&block.body) {
                if !COVERED.iter().any(|(start, _)| command.starts_with(start)) {
                    unlisted.push(format!("{}:{}: {command}", page.display(), block.line));
                }
            }
        }
    }
    assert!(
        unlisted.is_empty(),
        "commands in ```shell blocks that nothing runs: make them ```sh (run here), or list them in COVERED \
         with the test or CI step that runs them:\n{}",
        unlisted.join("\n")
    );
}

#[test]
fn every_fenced_block_says_its_language() {
    const KNOWN: &[&str] = &["sh", "shell", "text", "python", "rust", "c", "toml", "yaml", "json"];
    for (page, text) in pages().iter().filter(|(p, _)| !generated(p)) {
        for block in blocks(text) {
            assert!(
                KNOWN.contains(&block.lang.as_str()),
                "{}:{}: a block fenced ```{} : say which of {KNOWN:?} it is (sh: run by tools/tests/tools/readme.rs; \
                 shell: shown, and listed in its COVERED)",
                page.display(),
                block.line,
                block.lang
            );
        }
    }
}

#[test]
fn the_readme_stays_a_front_door() {
    let readme = std::fs::read_to_string(common::repo_root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(lines <= 250, "README.md has {lines} lines: keep it a front door (at most 250) and move the rest into docs/");
}

#[test]
fn ci_runs_exactly_the_test_command_the_readme_shows() {
    let root = common::repo_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let shown: Vec<String> = blocks(&readme).into_iter().filter(|b| b.lang == "shell").flat_map(|b| commands(&b.body)).collect();
    assert!(shown.iter().any(|c| c == "./test.sh"), "README shows no ./test.sh: {shown:?}");
    let ci = std::fs::read_to_string(root.join(".ci/run")).unwrap();
    let last = ci.lines().map(str::trim).rfind(|l| !l.is_empty() && !l.starts_with('#')).unwrap();
    assert_eq!(last, "exec ./test.sh", ".ci/run must end by running README's test command");
    assert!(root.join("test.sh").is_file());
}

/// The ```c block of README and the ```text block after its build commands.
fn c_quick_start() -> (String, String) {
    let readme = std::fs::read_to_string(common::repo_root().join("README.md")).unwrap();
    let all = blocks(&readme);
    let at = all.iter().position(|b| b.lang == "c").expect("README's C quick start");
    let expected = all[at + 1..].iter().take(2).find(|b| b.lang == "text").expect("the output of README's C quick start");
    (all[at].body.clone(), expected.body.clone())
}

#[test]
fn the_c_quick_start_compiles_and_prints_what_the_readme_shows() {
    let (program, expected) = c_quick_start();
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("quick_start.c");
    std::fs::write(&source, program).unwrap();
    let exe = common::build_against_cdylib("cc", &["-std=c11", "-Wall", "-Werror"], &[source.to_str().unwrap()], "readme_quick_start");
    // As README runs it, with the registry in a folder of the test's.
    let out = Command::new(&exe).env("TIDEPOOL_CONF", "backend:host").env("XDG_RUNTIME_DIR", dir.path()).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}{stdout}{}", out.status, String::from_utf8_lossy(&out.stderr));
    assert!(shows(&expected, &stdout), "README's C quick start printed\n{stdout}\nwhere README shows\n{expected}");
}

/// README's Rust quick start, as a test runs it: the lines between the
/// markers must be README's ```rust block (laid out as README shows it).
#[rustfmt::skip]
fn rust_quick_start() -> Result<(), Box<dyn std::error::Error>> {
    // README: rust quick start
    use tidepool::{Allocator, Config, Stream};

    let config = Config::builder().host(1, 8 << 30).build()?; // one 8 GiB simulated device
    // on a GPU: Config::builder().conf("backend:cuda")?.build()?, or Config::from_env()
    let alloc = Allocator::new(config)?;
    let mut x = alloc.alloc_buffer::<f32>(0, 1 << 20, Stream::DEFAULT)?; // device 0, default stream
    x.copy_from_host(&vec![1.0; 1 << 20])?;                  // in the stream's order
    // kernels take x.as_device_ptr(), the raw device address
    drop(x);                                                  // back to the cache, on its stream
    let stats = alloc.stats(0)?;
    println!("{} bytes allocated, fragmentation {:.0} %",
             stats.allocated_bytes.all.current, 100.0 * stats.fragmentation());
    alloc.empty_cache();                                      // whole free segments back to the driver
    // end of README's rust quick start
    Ok(())
}

#[test]
fn the_rust_quick_start_runs_and_is_the_one_the_readme_shows() {
    rust_quick_start().unwrap();
    let source = include_str!("readme.rs");
    let start = source.find("    // README: rust quick start\n").unwrap() + "    // README: rust quick start\n".len();
    let end = source.find("    // end of README's rust quick start").unwrap();
    let here: Vec<&str> = source[start..end].lines().map(|l| l.strip_prefix("    ").unwrap_or(l)).collect();
    let readme = std::fs::read_to_string(common::repo_root().join("README.md")).unwrap();
    let block = blocks(&readme).into_iter().find(|b| b.lang == "rust").expect("README's Rust quick start");
    let shown: Vec<&str> = block.body.lines().collect();
    assert_eq!(shown, here, "README's Rust quick start differs from rust_quick_start in tools/tests/tools/readme.rs");
}

/// GitHub's anchors of a page's headings (`## Will my model fit?` is
/// `#will-my-model-fit`; a repeated heading gets `-1`, `-2`, ...).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut in_block = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        let Some(heading) = line.strip_prefix('#').filter(|_| !in_block) else { continue };
        let heading = heading.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let slug: String = heading
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut anchor = slug.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{slug}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// The targets of a page's Markdown links, with their line, outside code
/// blocks and code spans.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut in_block = false;
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if in_block {
            continue;
        }
        // Code spans out: `[x](y)` inside backticks is not a link.
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let end = rest.find(')').unwrap_or(rest.len());
            out.push((n + 1, rest[..end].trim().to_string()));
            rest = &rest[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let root = common::repo_root();
    let mut broken = Vec::new();
    let mut checked = 0;
    for (page, text) in pages() {
        for (line, target) in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = target.split_once('#').map_or((target.as_str(), None), |(f, a)| (f, Some(a)));
            let path = if file.is_empty() { root.join(&page) } else { root.join(page.parent().unwrap()).join(file) };
            checked += 1;
            if !path.exists() {
                broken.push(format!("{}:{line}: {target}: no file {}", page.display(), path.display()));
                continue;
            }
            if let Some(anchor) = anchor {
                let heads = if path.extension().is_some_and(|e| e == "md") {
                    anchors(&std::fs::read_to_string(&path).unwrap())
                } else {
                    BTreeSet::new()
                };
                if !heads.contains(anchor) {
                    broken.push(format!("{}:{line}: {target}: no heading #{anchor} in {}", page.display(), path.display()));
                }
            }
        }
    }
    assert!(checked > 50, "only {checked} links found: is the parser right?");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_comparison_reads_elisions_and_spaces_as_documented() {
    assert!(shows("a  b\nc\n", "a b c\n"));
    assert!(shows("first\n...\nlast\n", "first\nmiddle\nmore\nlast\n"));
    assert!(shows("first\n...\nlast\n", "first\nlast\n"));
    assert!(!shows("first\n...\nlast\n", "first\nmiddle\n"));
    assert!(shows("x\n  replay speed 1 M ev/s\n", "x\n  replay speed 9 M ev/s\n"));
    assert_eq!(commands("a \\\n  b   # c\n\n# d\ne '#f'\n"), ["a b", "e '#f'"]);
    assert_eq!(
        anchors("## Will my model fit?\n## `tidepool top`\n## A\n## A\n").into_iter().collect::<Vec<_>>(),
        ["a", "a-1", "tidepool-top", "will-my-model-fit"]
    );
}
