//! The documentation tells the truth: the configuration page is what
//! `tidepool config --markdown` writes from the options table.

use std::process::Command;

use crate::common;

#[test]
fn the_configuration_page_is_the_one_the_options_table_writes() {
    let out = Command::new(env!("CARGO_BIN_EXE_tidepool")).args(["config", "--markdown"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let page = std::fs::read_to_string(common::repo_root().join("docs/configuration.md")).unwrap();
    assert!(
        page == String::from_utf8_lossy(&out.stdout),
        "docs/configuration.md differs from the options table: write it again with\n  \
         cargo run -p tidepool-tools -- config --markdown > docs/configuration.md"
    );
    // Every option of the table is on the page.
    for spec in tidepool::config::OPTIONS {
        assert!(page.contains(&format!("| `{}` |", spec.key)), "{} missing", spec.key);
    }
}
