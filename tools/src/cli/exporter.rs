//! `tidepool exporter`: the figures of every tidepool process on this
//! machine for Prometheus, served over HTTP or written to a textfile for
//! node_exporter.

use std::path::PathBuf;

use tidepool_tools::exporter::serve::{serve, ServeOptions};
use tidepool_tools::exporter::{self, Exporter};

use super::{args, out};

/// Serves the figures of every tidepool process on this machine at
/// http://ADDR:PORT/metrics (Prometheus text, or OpenMetrics when the
/// scraper asks for it), read afresh at each scrape; with --textfile,
/// writes the same text to PATH for node_exporter's textfile collector
#[derive(clap::Args)]
#[command(override_usage = "tidepool exporter [--listen ADDR:PORT] [--registry-dir DIR]... [--textfile PATH [--interval SECS] [--once]]
                         [--timeout SECS] [--max-connections N]")]
pub struct Args {
    /// Where to serve (an address or a host name; default 127.0.0.1:9464); with --textfile and no --listen there is no server
    #[arg(long, value_name = "ADDR:PORT")]
    listen: Option<String>,
    /// A folder of registries to read (default: TIDEPOOL_CONF's registry_dir); give it again for more
    #[arg(long, value_name = "DIR")]
    registry_dir: Vec<PathBuf>,
    /// Writes the scrape to PATH every --interval seconds, atomically
    #[arg(long, value_name = "PATH")]
    textfile: Option<PathBuf>,
    /// Seconds between two writes of the textfile
    #[arg(long, value_name = "SECS", default_value = "15", value_parser = seconds)]
    interval: f64,
    /// Writes the textfile once, then exits
    #[arg(long)]
    once: bool,
    /// Seconds a connection may take to send its request
    #[arg(long, value_name = "SECS", default_value = "10", value_parser = seconds)]
    timeout: f64,
    /// Connections open at once; at the bound the oldest idle one is closed to make room
    #[arg(long, value_name = "N", default_value = "64", value_parser = connections)]
    max_connections: usize,
}

/// A number of seconds, more than 0 and at most a day.
fn seconds(text: &str) -> Result<f64, String> {
    text.parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0 && *s <= 86_400.0)
        .ok_or_else(|| format!("expected seconds, got {text:?}"))
}

fn connections(text: &str) -> Result<usize, String> {
    text.parse().ok().filter(|n| (1..=4096).contains(n)).ok_or_else(|| format!("expected 1 to 4096, got {text:?}"))
}

pub fn run(args: Args) -> Result<(), String> {
    let Args { listen, registry_dir: mut dirs, textfile, interval, once, timeout, max_connections } = args;
    if once && textfile.is_none() {
        return Err("exporter: --once writes the textfile once: give --textfile".into());
    }
    if once && listen.is_some() {
        return Err("exporter: --once writes the textfile once and exits: it serves nothing, so give no --listen".into());
    }
    if dirs.is_empty() {
        dirs.push(args::registry_dir(None)?);
    }
    let exporter = std::sync::Arc::new(Exporter::new(dirs, exporter::hostname()));
    let serving = listen.is_some() || textfile.is_none();
    let listener = if serving {
        let listen = listen.unwrap_or_else(|| "127.0.0.1:9464".into());
        // An address or a host name ("localhost:9464"): its first address.
        let addr = std::net::ToSocketAddrs::to_socket_addrs(listen.as_str())
            .ok()
            .and_then(|mut addrs| addrs.next())
            .ok_or_else(|| format!("exporter: --listen: expected ADDR:PORT or HOST:PORT, got {listen:?}"))?;
        let listener = exporter::serve::listen(addr).map_err(|e| format!("exporter: cannot listen on {addr}: {e}"))?;
        let bound = listener.local_addr().map_err(|e| e.to_string())?;
        if !bound.ip().is_loopback() {
            eprintln!("tidepool exporter: warning: serving on {bound}, beyond this machine: whoever reaches it sees process names and memory figures");
        }
        // The bound address (a port 0 becomes the one the kernel chose), for scripts and tests.
        out!("tidepool exporter: listening on {bound}, metrics at http://{bound}/metrics");
        Some(listener)
    } else {
        None
    };
    let dirs: Vec<String> = exporter.dirs().iter().map(|d| d.display().to_string()).collect();
    eprintln!("tidepool exporter: reading the registries in {}", dirs.join(", "));
    if let Some(path) = textfile {
        if once {
            return exporter::write_textfile(&exporter, &path).map_err(|e| format!("exporter: --textfile {}: {e}", path.display()));
        }
        let interval = std::time::Duration::from_secs_f64(interval);
        let exporter = exporter.clone();
        let writer = move || loop {
            if let Err(err) = exporter::write_textfile(&exporter, &path) {
                eprintln!("tidepool exporter: --textfile {}: {err}", path.display());
            }
            std::thread::sleep(interval);
        };
        match listener {
            None => writer(),
            Some(_) => {
                std::thread::Builder::new().name("tidepool-textfile".into()).spawn(writer).map_err(|e| format!("exporter: {e}"))?;
            }
        }
    }
    let options = ServeOptions { timeout: std::time::Duration::from_secs_f64(timeout), max_connections };
    serve(exporter, listener.expect("serving"), options)
}
