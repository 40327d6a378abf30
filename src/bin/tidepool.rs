//! The `tidepool` command line.
//!
//! `tidepool config` prints every option of TIDEPOOL_CONF with its default
//! and the value the current environment gives it.

use std::process::ExitCode;

use tidepool::config::OPTIONS;
use tidepool::Config;

const USAGE: &str = "\
tidepool: a CUDA caching allocator that gives memory back

usage:
  tidepool config            the options of TIDEPOOL_CONF, their defaults and current values
  tidepool --version         the version
  tidepool help              this text
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("config") => {
            print_config();
            ExitCode::SUCCESS
        }
        Some("--version") | Some("-V") => {
            println!("tidepool {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Some("help") | Some("--help") | Some("-h") | None => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprint!("tidepool: unknown command {other:?}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn print_config() {
    let text = std::env::var("TIDEPOOL_CONF").unwrap_or_default();
    let (config, warnings) = Config::parse(&text);
    for warning in &warnings {
        eprintln!("tidepool: warning: TIDEPOOL_CONF: {warning}");
    }
    println!("TIDEPOOL_CONF={text:?}\n");
    println!("{:<26} {:<10} {:<10} meaning", "key", "default", "current");
    for spec in OPTIONS {
        println!("{:<26} {:<10} {:<10} {}", spec.key, spec.default, (spec.show)(&config), spec.help);
    }
}
