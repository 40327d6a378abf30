//! Builds tests/c/tags_test.c against the cdylib and runs it on the host
//! backend and on the cuda backend over simgpu (pinned host memory from
//! cuMemHostAlloc, copies through the driver), and under valgrind memcheck
//! (skipped without valgrind, except under `CI=true`, where that fails).

use crate::common;

use std::path::PathBuf;
use std::process::Command;

fn build(name: &str) -> PathBuf {
    let flags = ["-std=c11", "-D_DEFAULT_SOURCE", "-Wall", "-Wextra", "-Werror", "-O1", "-pthread"];
    common::build_against_cdylib("cc", &flags, &["tests/c/tags_test.c"], name)
}

fn run(program: &PathBuf, env: &[(&str, &str)]) -> (bool, String) {
    let output = common::contained(Command::new(program).envs(env.iter().copied())).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    (output.status.success(), text)
}

#[test]
fn tags_pause_and_resume_through_the_c_abi_on_the_host_backend() {
    let program = build("tags_test");
    let (ok, text) = run(&program, &[("TIDEPOOL_CONF", "backend:host,host_capacity_mb:1024")]);
    assert!(ok && text.contains(" passed, 0 failed"), "tags_test failed:\n{text}");
}

#[test]
fn tags_pause_and_resume_through_the_c_abi_on_the_cuda_backend_over_simgpu() {
    let program = build("tags_test_cuda");
    let simgpu = common::simgpu_dir();
    let env = [("TIDEPOOL_CONF", "backend:cuda"), ("LD_LIBRARY_PATH", simgpu.to_str().unwrap()), ("SIMGPU_CAPACITY", "1024M")];
    let (ok, text) = run(&program, &env);
    assert!(ok && text.contains(" passed, 0 failed"), "tags_test over cuda/simgpu failed:\n{text}");
}

#[test]
fn an_offload_without_pinned_host_memory_is_refused_with_its_code_over_simgpu() {
    let source = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("tidepool_tags_nohost.c");
    std::fs::write(
        &source,
        r#"#include "tidepool.h"
#include <stdio.h>
#include <string.h>
int main(void) {
    tidepool_set_tag("w");
    char* p = tidepool_malloc(4 << 20, 0, NULL);
    tidepool_set_tag(NULL);
    if (!p) return 2;
    memset(p, 0x3C, 4 << 20);
    tidepool_tag_stats s; memset(&s, 0, sizeof s); s.size = sizeof s;
    tidepool_get_tag_stats("w", 0, &s);
    int rc = tidepool_pause("w", 0, TIDEPOOL_PAUSE_OFFLOAD);
    char err[512]; tidepool_last_error(err, sizeof err);
    tidepool_tag_stats t; memset(&t, 0, sizeof t); t.size = sizeof t;
    tidepool_get_tag_stats("w", 0, &t);
    int same = t.paused == 0 && t.reserved_bytes == s.reserved_bytes && p[12345] == 0x3C;
    int discard = tidepool_pause("w", 0, 0) == TIDEPOOL_OK && tidepool_resume("w", 0) == TIDEPOOL_OK;
    printf("rc=%d same=%d discard=%d err=%s\n", rc, same, discard, err);
    return 0;
}
"#,
    )
    .unwrap();
    let program = common::build_against_cdylib("cc", &["-std=c11", "-Wall", "-Werror"], &[source.to_str().unwrap()], "tags_nohost");
    let simgpu = common::simgpu_dir();
    let env = [("TIDEPOOL_CONF", "backend:cuda"), ("LD_LIBRARY_PATH", simgpu.to_str().unwrap()), ("SIMGPU_FAIL_HOST_ALLOC", "1")];
    let (ok, text) = run(&program, &env);
    assert!(ok, "{text}");
    assert!(text.contains("rc=6 same=1 discard=1"), "{text}");
    assert!(text.contains("nothing was released"), "{text}");
}

#[test]
fn the_tag_calls_are_clean_under_valgrind_memcheck() {
    if common::tool("valgrind", "apt-get install valgrind").is_none() {
        return;
    }
    let program = build("tags_test_valgrind");
    let mut valgrind = Command::new("valgrind");
    valgrind
        .args(["--error-exitcode=99", "--leak-check=no", "-q"])
        .arg(&program)
        .env("TIDEPOOL_CONF", "backend:host,host_capacity_mb:1024");
    let output = common::contained(&mut valgrind).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success() && text.contains(" passed, 0 failed"), "tags_test under valgrind failed:\n{text}");
    assert!(!text.contains("Invalid read") && !text.contains("Invalid write"), "{text}");
}
