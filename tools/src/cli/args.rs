//! What replay and plan share: sizes as a person writes them, the
//! policies to compare, the configuration and the trace files, each
//! checked before any replay takes time.

use std::path::{Path, PathBuf};

use tidepool::{registry, Config};
use tidepool_tools::trace::replay::Model;
use tidepool_tools::trace::{self, Trace};

/// "24GiB", "512M", "24GB", "1073741824" -> bytes. KiB, MiB, GiB and TiB
/// and their first letters alone (K, M, G, T) are binary, as PyTorch and
/// `nvidia-smi` count; KB, MB, GB and TB decimal, as `--cards` and card
/// vendors read them (24GB: 24·10^9 bytes).
pub fn size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number.parse().map_err(|_| format!("bad size {text:?}"))?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(format!("bad size {text:?}: unknown unit {unit:?}")),
    };
    let bytes = number * scale as f64;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < 2f64.powi(62)) {
        return Err(format!("bad size {text:?}"));
    }
    // "--capacity 8 GiB" reads 8 bytes and a file named GiB: no one means
    // a device or a step of a few bytes.
    if unit.trim().is_empty() && bytes < (1u64 << 20) as f64 {
        return Err(format!("bad size {text:?}: a number alone is bytes; write its unit, in one word (\"{text}GiB\", \"{text}MiB\")"));
    }
    Ok(bytes as u64)
}

/// "pytorch,tidepool" (each `--policy` given) -> the models, each once,
/// where first named.
pub fn models(given: &[String]) -> Result<Vec<Model>, String> {
    let mut models = Vec::new();
    for name in given.iter().flat_map(|text| text.split(',')) {
        let model = match name.trim() {
            "all" => {
                models.extend(Model::ALL);
                continue;
            }
            // Earlier releases' name for tidepool and pytorch.
            "both" => {
                models.extend([Model::Tidepool, Model::Pytorch]);
                continue;
            }
            // Earlier releases' name for tidepool with expandable segments,
            // now tidepool's default.
            "expandable" => Some(Model::Tidepool),
            other => Model::ALL.into_iter().find(|p| p.name() == other),
        };
        let expected = "pytorch, tidepool, whole-segments, pytorch-expandable or all";
        models.push(model.ok_or_else(|| format!("--policy: expected {expected}, got {name:?}"))?);
    }
    let mut unique = Vec::new();
    for model in models {
        if !unique.contains(&model) {
            unique.push(model);
        }
    }
    Ok(unique)
}

/// Each `--conf` given, as one configuration (later keys win, as in
/// TIDEPOOL_CONF), checked.
pub fn conf(given: &[String]) -> Result<String, String> {
    let conf = given.join(",");
    Config::builder().conf(&conf).map_err(|e| format!("--conf: {e}"))?;
    Ok(conf)
}

/// Every trace file opens, and the plot's folder exists, before the first
/// replay takes time.
pub fn check_files(files: &[PathBuf], plot: Option<&Path>) -> Result<(), String> {
    if files.is_empty() {
        return Err("no trace file given (`tidepool help` lists the commands and their options)".into());
    }
    for file in files {
        std::fs::File::open(file).map_err(|err| format!("{}: cannot open: {err}", file.display()))?;
    }
    if let Some(parent) = plot.and_then(Path::parent).filter(|p| !p.as_os_str().is_empty()) {
        if !parent.is_dir() {
            return Err(format!("--plot: no folder {}", parent.display()));
        }
    }
    Ok(())
}

/// The registries' folder: the one given, else TIDEPOOL_CONF's
/// `registry_dir`, else the default; a TIDEPOOL_CONF with a problem is
/// refused (the command would not do what it says).
pub fn registry_dir(given: Option<PathBuf>) -> Result<PathBuf, String> {
    if let Some(dir) = given {
        return Ok(dir);
    }
    let (config, problems) = Config::from_env_with_warnings();
    if !problems.is_empty() {
        return Err(problems_text(&problems));
    }
    Ok(config.registry_dir.unwrap_or_else(registry::default_dir))
}

/// What is wrong with TIDEPOOL_CONF, a line each as the allocator's
/// warnings say it (`tidepool: ` before each): at most as many lines as the
/// allocator prints, then how many more.
pub fn problems_text(problems: &[String]) -> String {
    const MAX: usize = 20;
    let mut lines: Vec<String> = problems.iter().take(MAX).map(|p| format!("TIDEPOOL_CONF: {p}")).collect();
    if problems.len() > MAX {
        lines.push(format!("TIDEPOOL_CONF: and {} more", problems.len() - MAX));
    }
    lines.join("\ntidepool: ")
}

/// Reads a trace; what its reader stepped over is one line on stderr.
pub fn load(path: &Path) -> Result<Trace, String> {
    let trace = trace::load(path).map_err(|e| e.to_string())?;
    if trace.warnings.count > 0 {
        let count = trace.warnings.count;
        let noun = if count == 1 { "warning" } else { "warnings" };
        eprintln!("tidepool: {}: {count} {noun}, first: {}", path.display(), trace.warnings.first[0]);
    }
    Ok(trace)
}

#[cfg(test)]
mod tests {
    use super::size;

    #[test]
    fn sizes_read_binary_and_decimal_units_as_their_names_say() {
        assert_eq!(size("24GiB"), Ok(24 << 30));
        assert_eq!(size("24G"), Ok(24 << 30));
        assert_eq!(size("24GB"), Ok(24_000_000_000), "GB as --cards and vendors read it");
        assert_eq!(size("1.5 MB"), Ok(1_500_000));
        assert_eq!(size("1073741824"), Ok(1 << 30));
        assert!(size("24 GiBs").unwrap_err().contains("unknown unit"));
        assert!(size("8").unwrap_err().contains("write its unit"));
    }
}
