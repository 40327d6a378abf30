//! `tidepool config` and the commands that read TIDEPOOL_CONF: a bad
//! configuration is an error that says what is wrong, in at most about
//! twenty lines, and loses nothing else.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::process::Command;

/// (exit status 0, stdout, stderr) of `tidepool ARGS` with TIDEPOOL_CONF = `conf`.
fn with_conf(conf: &OsStr, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tidepool")).args(args).env("TIDEPOOL_CONF", conf).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn a_byte_that_is_not_utf8_costs_its_option_only_and_is_named() {
    let conf = OsStr::from_bytes(b"backend:host,expandable:true,x:\xff");
    let (ok, stdout, stderr) = with_conf(conf, &["config"]);
    assert!(!ok && stderr.contains("ignoring \"x:\u{fffd}\": not UTF-8") && stderr.lines().count() == 1, "{stderr}");
    let current =
        |key: &str| stdout.lines().find(|l| l.starts_with(&format!("{key} "))).unwrap().split_whitespace().nth(2).unwrap().to_string();
    assert_eq!((current("backend"), current("expandable")), ("host".to_string(), "true".to_string()), "{stdout}");
}

#[test]
fn ten_kilobytes_of_unknown_keys_take_about_twenty_lines() {
    let junk: Vec<String> = (0..1000).map(|i| format!("junk_key_{i}:1")).collect();
    let (ok, _, stderr) = with_conf(OsStr::new(&junk.join(",")), &["config"]);
    assert!(!ok && stderr.lines().count() == 21 && stderr.trim_end().ends_with("TIDEPOOL_CONF: and 980 more"), "{stderr}");
}

#[test]
fn values_out_of_range_are_refused_with_the_range_by_every_command_that_reads_them() {
    let conf = OsStr::new("host_capacity_mb:0");
    let said = "tidepool: TIDEPOOL_CONF: ignoring \"host_capacity_mb:0\": host_capacity_mb: must be at least 1, got 0";
    for args in [&["config"][..], &["top", "--once"], &["exporter", "--textfile", "/dev/null", "--once"]] {
        let (ok, _, stderr) = with_conf(conf, args);
        assert!(!ok && stderr.trim_end() == said, "{args:?}: {stderr}");
    }
    // A folder named on the command line needs nothing of TIDEPOOL_CONF.
    let (ok, _, stderr) = with_conf(conf, &["top", "--once", "--registry-dir", "/nonexistent"]);
    assert!(ok, "{stderr}");
}
