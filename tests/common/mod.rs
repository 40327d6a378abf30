//! Helpers shared by the integration tests: an allocator on a host backend
//! the test keeps a handle to, a small deterministic RNG, and byte patterns.
#![allow(dead_code)]

pub mod conformance;
pub mod simgpu;

use std::sync::Arc;

use tidepool::backend::host::HostBackend;
use tidepool::{Allocator, Config, DevicePtr};

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;

/// An allocator over `devices` host devices of `capacity` bytes, plus the
/// backend for fault injection. The time-driven release policies are off
/// (tests of the reclaimer turn them on in `conf`), so nothing changes
/// behind a test's back.
pub fn host_allocator(devices: usize, capacity: u64, conf: &str) -> (Allocator, Arc<HostBackend>) {
    let config =
        Config::builder().conf("release_after_ms:off,headroom_mb:0").unwrap().conf(conf).unwrap().host(devices, capacity).build().unwrap();
    let backend = Arc::new(HostBackend::new(devices, capacity));
    (Allocator::with_backend(config, backend.clone()), backend)
}

/// The configuration of a process sharing a 1 GiB host device and its
/// registry under `dir` with other processes, publishing every 20 ms.
pub fn shared_host_conf(dir: &std::path::Path, cooperative: bool) -> String {
    format!(
        "backend:host,host_shared:{},registry_dir:{},host_capacity_mb:1024,release_after_ms:off,headroom_mb:0,\
         reclaim_interval_ms:20,cooperative:{cooperative},oom_wait_ms:5000",
        dir.join("capacity").display(),
        dir.join("registry").display()
    )
}

/// Bytes device 0 reserves now.
pub fn reserved(alloc: &Allocator) -> u64 {
    alloc.stats(0).unwrap().reserved_bytes.all.current
}

/// xorshift64*: deterministic, dependency-free.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// True `percent` times in a hundred.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// Offsets of a block that patterns cover: every byte of a small block,
/// and for a large one the first and last 4 KiB and one 4 KiB window per MiB.
fn pattern_windows(len: u64) -> Vec<(u64, u64)> {
    if len <= 64 * KIB {
        return vec![(0, len)];
    }
    let tail = (len - 4 * KIB) & !7;
    let mut windows = vec![(0, 4 * KIB), (tail, tail + 4 * KIB)];
    let mut at = MIB;
    while at + 4 * KIB < len - 4 * KIB {
        windows.push((at, at + 4 * KIB));
        at += MIB;
    }
    windows
}

/// Writes a pattern derived from `tag` over `len` bytes at `ptr` (8-byte
/// words; a tail shorter than a word is left alone).
pub fn fill(ptr: DevicePtr, len: u64, tag: u64) {
    for (start, end) in pattern_windows(len) {
        for (i, word) in words(ptr, start, end).iter_mut().enumerate() {
            *word = pattern_word(tag, start / 8 + i as u64);
        }
    }
}

/// Checks the pattern written by `fill`; returns the first bad offset.
pub fn check(ptr: DevicePtr, len: u64, tag: u64) -> Result<(), u64> {
    for (start, end) in pattern_windows(len) {
        for (i, word) in words(ptr, start, end).iter().enumerate() {
            if *word != pattern_word(tag, start / 8 + i as u64) {
                return Err(start + 8 * i as u64);
            }
        }
    }
    Ok(())
}

fn words<'a>(ptr: DevicePtr, start: u64, end: u64) -> &'a mut [u64] {
    assert!(ptr.0.is_multiple_of(8) && start.is_multiple_of(8));
    // SAFETY: `ptr` is a live host-backend block of at least `end` bytes,
    // 512-byte aligned, that only the calling test thread uses while it
    // holds the slice.
    unsafe { std::slice::from_raw_parts_mut((ptr.0 + start) as *mut u64, ((end - start) / 8) as usize) }
}

#[inline]
fn pattern_word(tag: u64, index: u64) -> u64 {
    (tag ^ 0xA5A5_5A5A_0F0F_F0F0).wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(index.wrapping_mul(0x1000_0000_0000_0001))
}

/// The repository's root, where the workspace's Cargo.lock is (the
/// allocator's tests run from it, the tools' from tools/).
pub fn repo_root() -> &'static std::path::Path {
    let crate_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    crate_dir.ancestors().find(|dir| dir.join("Cargo.lock").is_file()).expect("the workspace's Cargo.lock")
}

/// `../shared/traces/RELATIVE`, the real traces beside the repository,
/// when there. Where `../shared` is but that trace is not (an incomplete
/// copy), a test under `CI=true` fails; where there is no `../shared` at
/// all, the test names on stderr what it did not check.
pub fn shared_traces(relative: &str) -> Option<std::path::PathBuf> {
    let shared = repo_root().join("../shared");
    let path = shared.join("traces").join(relative);
    if path.exists() {
        return Some(path);
    }
    assert!(!(in_ci() && shared.is_dir()), "CI=true: {} is missing: an incomplete copy of ../shared/traces", path.display());
    eprintln!("{} not found: not checked (the real traces sit beside the repository, in ../shared/traces)", path.display());
    None
}

/// The C library (libtidepool.so) of this build, built on first use:
/// `cargo test` builds the crate as a Rust library only.
pub fn cdylib() -> std::path::PathBuf {
    static BUILD: std::sync::Once = std::sync::Once::new();
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(std::path::Path::parent).unwrap().to_path_buf();
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    BUILD.call_once(|| {
        let mut build = std::process::Command::new(env!("CARGO"));
        build.args(["build", "--lib", "--quiet", "-p", "tidepool", "--manifest-path"]).arg(repo_root().join("Cargo.toml"));
        if release {
            build.arg("--release");
        }
        let status = build.status().expect("cargo runs");
        assert!(status.success(), "building libtidepool.so failed");
    });
    profile_dir.join("libtidepool.so")
}

/// Compiles `sources` (paths from the crate root) with `compiler` and
/// `flags` against this build's cdylib and ffi/tidepool.h, into the test
/// scratch directory as `name` (one name per test: tests run in parallel).
pub fn build_against_cdylib(compiler: &str, flags: &[&str], sources: &[&str], name: &str) -> std::path::PathBuf {
    let root = repo_root();
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let lib = cdylib().parent().unwrap().to_path_buf();
    let status = std::process::Command::new(compiler)
        .args(flags)
        .arg("-I")
        .arg(root.join("ffi"))
        .args(sources.iter().map(|source| root.join(source)))
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-ltidepool", "-o"])
        .arg(&out)
        .status()
        .unwrap_or_else(|err| panic!("the compiler {compiler} is needed to build {sources:?}: {err}"));
    assert!(status.success(), "compiling {sources:?} failed");
    out
}

/// The address of `name` in the libcuda.so this process loaded (simgpu,
/// found through LD_LIBRARY_PATH), for a test to cast to the C signature
/// cuda/simgpu/simgpu.c declares. Panics when the loaded driver is not
/// simgpu.
pub fn simgpu_symbol(name: &std::ffi::CStr) -> *mut libc::c_void {
    // SAFETY: dlopen of a library this process has loaded only takes a
    // reference to it; dlsym reads an address and calls nothing.
    unsafe {
        let handle = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW);
        assert!(!handle.is_null(), "simgpu not loaded");
        let symbol = libc::dlsym(handle, name.as_ptr());
        assert!(!symbol.is_null(), "{name:?} missing: not simgpu");
        symbol
    }
}

/// Builds cuda/simgpu (the stand-in libcuda.so) into a directory of its
/// own and returns that directory, for LD_LIBRARY_PATH.
pub fn simgpu_dir() -> std::path::PathBuf {
    let root = repo_root();
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("simgpu");
    std::fs::create_dir_all(&dir).unwrap();
    // Built under a name of its own, then renamed: tests build it in parallel.
    let out = dir.join(format!("libcuda.so.{}.{:?}", std::process::id(), std::thread::current().id()));
    let status = std::process::Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-O2", "-pthread"])
        .arg(root.join("cuda/simgpu/simgpu.c"))
        .arg("-o")
        .arg(&out)
        .status()
        .expect("a C compiler (cc) is needed to build simgpu");
    assert!(status.success(), "building simgpu failed");
    std::fs::rename(&out, dir.join("libcuda.so")).unwrap();
    dir
}

/// An allocator configured by a `TIDEPOOL_CONF` string alone.
pub fn conf_allocator(conf: &str) -> Allocator {
    Allocator::new(Config::builder().conf(conf).unwrap().build().unwrap()).unwrap()
}

/// Polls every 10 ms until `done` or the timeout; whether it became true.
pub fn eventually(timeout: std::time::Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < timeout {
        if done() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    done()
}

/// A fresh directory for one test (`tidepool-NAME-...` under the system's
/// temporary directory), removed with everything in it when the returned
/// guard goes, whether the test passed or failed.
pub fn scratch_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("tidepool-{name}-")).tempdir().expect("a temporary directory")
}

/// Writes `contents` to `path` so that a process waiting for the file
/// (`wait_for_file`) never reads it half written: into a file beside it,
/// then renamed.
pub fn write_whole(path: &std::path::Path, contents: impl AsRef<[u8]>) {
    let partial = path.with_extension("partial");
    std::fs::write(&partial, contents).unwrap();
    std::fs::rename(&partial, path).unwrap();
}

/// Whether the file `path` appears within `timeout` (processes of a test
/// tell each other where they are by files).
pub fn wait_for_file(path: &std::path::Path, timeout: std::time::Duration) -> bool {
    eventually(timeout, || path.exists())
}

// ---- child processes -----------------------------------------------------
//
// A test that only makes sense in a process of its own (`child_*`,
// `process_*`) is `#[ignore]`d, so that a plain `cargo test` counts only real
// tests; its parent test runs it in a child process with `--ignored --exact`
// and TIDEPOOL_TEST_CHILD set, and fails when it fails.

/// The command that runs the ignored test `name` of this test binary in a
/// child process (one thread, output not captured); the caller adds its
/// environment and runs it (`child_output`) or spawns it. Its stdout (the
/// harness's "running 1 test ... test result" lines) goes nowhere unless
/// the caller takes it (`child_output`, `spawn_child`), so that it does not
/// land in the parent's output; its stderr (a failing child's panic
/// message) is the parent's.
pub fn child_command(name: &str) -> std::process::Command {
    let mut command = std::process::Command::new(std::env::current_exe().unwrap());
    command.args(["--ignored", "--exact", &test_path(name), "--test-threads=1", "--nocapture"]).env("TIDEPOOL_TEST_CHILD", "1");
    command.stdout(std::process::Stdio::null());
    contained(&mut command);
    command
}

/// `command`, whose files stay under target/: the registries of a process
/// that names no folder (`$XDG_RUNTIME_DIR/tidepool`) and temporary files
/// (TMPDIR: pip's, Python's), so that a test run leaves nothing in /tmp.
pub fn contained(command: &mut std::process::Command) -> &mut std::process::Command {
    use std::os::unix::fs::DirBuilderExt;
    let base = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let (runtime, tmp) = (base.join("xdg-runtime"), base.join("tmp"));
    for dir in [&runtime, &tmp] {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).unwrap();
    }
    command.env("XDG_RUNTIME_DIR", runtime).env("TMPDIR", tmp)
}

/// The full name (`module::name`) of the one ignored test of this binary
/// called `name`: a binary groups several files, each a module.
fn test_path(name: &str) -> String {
    static LIST: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let list = LIST.get_or_init(|| {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--list", "--ignored"])
            .output()
            .expect("the test binary lists its tests");
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines().filter_map(|line| line.strip_suffix(": test")).map(str::to_string).collect()
    });
    let suffix = format!("::{name}");
    let found: Vec<&String> = list.iter().filter(|path| *path == name || path.ends_with(&suffix)).collect();
    match found.as_slice() {
        [path] => path.to_string(),
        _ => panic!("child test {name:?}: {} tests of this binary have that name: {found:?}", found.len()),
    }
}

/// Starts the child test `name` of this binary with `env`, its stdout piped.
pub fn spawn_child(name: &str, env: &[(&str, String)]) -> std::process::Child {
    let mut command = child_command(name);
    command.stdout(std::process::Stdio::piped()).envs(env.iter().map(|(k, v)| (*k, v)));
    command.spawn().unwrap()
}

/// Runs a `child_command` to its end: whether its one test ran and passed
/// (a name that matches no test runs none, which is no pass), and what it
/// printed.
pub fn child_output(command: &mut std::process::Command) -> (bool, String) {
    let out = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap_or_else(|err| panic!("cannot run {command:?}: {err}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let ran = stdout.contains("test result: ok. 1 passed;");
    (out.status.success() && ran, format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)))
}

/// The first line of a child test: it runs only under its parent, which
/// sets its environment (`--include-ignored` alone would run it without).
pub fn child_only() {
    assert!(
        std::env::var_os("TIDEPOOL_TEST_CHILD").is_some(),
        "a child-process test: its parent test runs it with --ignored --exact and the environment it needs"
    );
}

// ---- tools ---------------------------------------------------------------

/// Whether this is a CI run (`CI=true`, as `./test.sh` sets): there a tool a
/// test needs (python3 and torch, valgrind, nm, a C compiler, prometheus)
/// must be installed, and its absence fails the test instead of skipping it.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The path of the program `name` on PATH. Where it is missing: under
/// `CI=true` the test fails; elsewhere None, with a message (`install` says
/// how to get it), and the caller skips what needs it.
pub fn tool(name: &str, install: &str) -> Option<std::path::PathBuf> {
    let found = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join(name))
        .find(|path| path.is_file());
    if found.is_none() {
        assert!(!in_ci(), "CI=true: {name} is missing ({install}; ./test.sh installs it)");
        eprintln!("skipped: {name} is not installed ({install}); under CI=true this fails");
    }
    found
}
