//! The `tidepool` command line: one file per subcommand (replay, plan,
//! top, exporter, cards, config), the options they share in args.rs, and
//! here the parser (clap), help and the one-line messages a refused
//! command line gets.
//!
//! Exit codes: 0 on success (help and `--version` included), 2 for a
//! command line or an input that is refused, with one line on stderr that
//! says what is wrong.
#![forbid(unsafe_code)]

mod args;
mod cards;
mod config;
mod exporter;
mod plan;
mod replay;
mod top;

use std::ffi::OsString;
use std::process::ExitCode;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// `println!` that ends the process quietly when stdout is closed
/// (`tidepool replay ... | head`) instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if writeln!(std::io::stdout(), $($arg)*).is_err() {
            std::process::exit(0);
        }
    }};
}
pub(crate) use out;

/// Appended to a refused command line: one line, not the whole usage.
const SEE_HELP: &str = " (`tidepool help` lists the commands and their options)";

/// How sizes are written, after the help of the commands that take one.
const SIZES: &str = "SIZE: a number with its unit, KiB, MiB, GiB or TiB (K, M, G, T: the same, powers of 1024) or KB, \
MB, GB, TB (powers of 1000, as cards are sold: 24GB is 24*10^9 bytes), or bytes (from 1 MiB).";

/// Every help page: what the command does, then its usage and options.
const HELP: &str = "{about-with-newline}\nusage:\n  {usage}\n\n{all-args}{after-help}";

/// tidepool: a CUDA caching allocator that gives memory back.
#[derive(Parser)]
#[command(name = "tidepool", version, help_template = HELP, override_usage = "tidepool COMMAND [OPTIONS]")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    Replay(replay::Args),
    Plan(plan::Args),
    Top(top::Args),
    Exporter(exporter::Args),
    Cards(cards::Args),
    Config(config::Args),
    /// Prints a completion script for SHELL (bash, zsh, fish, elvish, powershell) to stdout
    #[command(override_usage = "tidepool completions SHELL")]
    Completions {
        #[arg(value_name = "SHELL")]
        shell: clap_complete::Shell,
    },
}

/// The parser, every page with the same help layout.
fn command() -> clap::Command {
    Cli::command().mut_subcommands(|sub| sub.help_template(HELP))
}

/// Runs the command line of this process.
pub fn run() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    let matches = match command().try_get_matches_from(&args) {
        Ok(matches) => matches,
        Err(err) => return refused_or_help(&err, &args),
    };
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(err) => return refused_or_help(&err, &args),
    };
    let result = match cli.command {
        Some(Command::Replay(args)) => replay::run(args),
        Some(Command::Plan(args)) => plan::run(args),
        Some(Command::Top(args)) => top::run(args),
        Some(Command::Exporter(args)) => exporter::run(args),
        Some(Command::Cards(args)) => cards::run(args),
        Some(Command::Config(args)) => config::run(args),
        Some(Command::Completions { shell }) => {
            clap_complete::generate(shell, &mut command(), "tidepool", &mut std::io::stdout());
            Ok(())
        }
        None => {
            out!("{}", command().render_help());
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("tidepool: {message}");
            ExitCode::from(2)
        }
    }
}

/// Help and the version go to stdout (exit 0); anything else clap refused
/// is one line on stderr (exit 2).
fn refused_or_help(err: &clap::Error, args: &[OsString]) -> ExitCode {
    if matches!(err.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand) {
        let _ = err.print(); // a closed stdout: nothing left to show it to
        return ExitCode::SUCCESS;
    }
    eprintln!("tidepool: {}", one_line(err, subcommand_of(args).as_deref()));
    ExitCode::from(2)
}

/// The subcommand a command line names, if it names one clap knows.
fn subcommand_of(args: &[OsString]) -> Option<String> {
    let word = args.iter().skip(1).map(|a| a.to_string_lossy()).find(|a| !a.starts_with('-'))?;
    command().get_subcommands().any(|s| s.get_name() == word).then(|| word.into_owned())
}

/// What is wrong with a refused command line, in one line.
fn one_line(err: &clap::Error, subcommand: Option<&str>) -> String {
    let context = |kind| match err.get(kind) {
        Some(ContextValue::String(text)) => text.clone(),
        Some(ContextValue::Strings(texts)) => texts.join(", "),
        _ => String::new(),
    };
    // "--capacity <SIZE>" names the option "--capacity".
    let option = context(ContextKind::InvalidArg).split([' ', '=']).next().unwrap_or_default().to_string();
    let prefix = subcommand.map(|s| format!("{s}: ")).unwrap_or_default();
    match err.kind() {
        ErrorKind::InvalidSubcommand => format!("unknown command {:?}{SEE_HELP}", context(ContextKind::InvalidSubcommand)),
        ErrorKind::UnknownArgument if option.starts_with('-') => format!("{prefix}unknown option {option}{SEE_HELP}"),
        ErrorKind::UnknownArgument => format!("{prefix}unexpected argument {option:?}{SEE_HELP}"),
        ErrorKind::InvalidValue if context(ContextKind::InvalidValue).is_empty() => format!("{prefix}{option} needs a value"),
        ErrorKind::ValueValidation | ErrorKind::InvalidValue => {
            let why = std::error::Error::source(err).map(|e| e.to_string());
            let why = why
                .unwrap_or_else(|| format!("{:?} is not one of {}", context(ContextKind::InvalidValue), context(ContextKind::ValidValue)));
            format!("{prefix}{option}: {why}")
        }
        ErrorKind::ArgumentConflict => format!("{prefix}{option} cannot be given with {}", context(ContextKind::PriorArg)),
        _ => {
            let text = err.render().to_string();
            let first = text.lines().next().unwrap_or_default().trim_start_matches("error: ");
            format!("{prefix}{first}{SEE_HELP}")
        }
    }
}
