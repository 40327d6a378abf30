//! The `tidepool` command: replay and plan allocation traces, watch the
//! processes of this machine (`top`) or serve their figures to Prometheus
//! (`exporter`), list the cards plans name, show the configuration.
#![forbid(unsafe_code)]

mod cli;

fn main() -> std::process::ExitCode {
    cli::run()
}
