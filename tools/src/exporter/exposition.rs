//! The exposition formats a scraper reads: the Prometheus text format
//! (0.0.4, what `text/plain` scrapers and node_exporter's textfile
//! collector parse) and OpenMetrics 1.0 text (what Prometheus asks for
//! first), written from one description of families and samples.
//!
//! The two differ in three places, all handled here: a counter family is
//! named with its `_total` suffix in the text format's HELP and TYPE lines
//! and without it in OpenMetrics' (its samples carry the suffix in both),
//! OpenMetrics also escapes `"` in HELP text, and OpenMetrics ends with
//! `# EOF`. Label values are escaped alike (`\\`, `\"`, `\n`).
//!
//! Invariants of the output: every family's HELP and TYPE lines come
//! before its samples, its samples are contiguous, and no family is
//! written twice (`Writer::family` asserts the last in debug builds).
#![forbid(unsafe_code)]

use std::fmt::Write as _;

/// Which format to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text format 0.0.4.
    Text,
    /// OpenMetrics 1.0.0 text.
    OpenMetrics,
}

impl Format {
    /// The `Content-Type` of a response in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Text => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }

    /// The format a request's `Accept` header prefers: OpenMetrics when
    /// it is accepted with at least the weight of the text format (which
    /// `text/plain`, `*/*` or no header at all accept), else text.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else { return Format::Text };
        let (mut openmetrics, mut text) = (0.0f64, 0.0f64);
        for range in accept.split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let mut q = 1.0;
            for param in parts {
                if let Some(value) = param.strip_prefix("q=").or_else(|| param.strip_prefix("Q=")) {
                    q = value.trim().parse::<f64>().ok().filter(|q| (0.0..=1.0).contains(q)).unwrap_or(0.0);
                }
            }
            match media.as_str() {
                "application/openmetrics-text" => openmetrics = openmetrics.max(q),
                "text/plain" | "text/*" | "*/*" => text = text.max(q),
                _ => {}
            }
        }
        if openmetrics > 0.0 && openmetrics >= text {
            Format::OpenMetrics
        } else {
            Format::Text
        }
    }
}

/// The type of a family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Gauge,
    Counter,
}

/// A rendered, escaped label set (`a="x",b="y"`), built once and reused
/// for every family a series appears in.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Labels(String);

impl Labels {
    /// Labels from (name, value) pairs; names must be valid label names.
    pub fn new(pairs: &[(&str, &str)]) -> Labels {
        let mut labels = Labels::default();
        for (name, value) in pairs {
            labels.push(name, value);
        }
        labels
    }

    /// These labels and one more.
    pub fn with(&self, name: &str, value: &str) -> Labels {
        let mut labels = self.clone();
        labels.push(name, value);
        labels
    }

    fn push(&mut self, name: &str, value: &str) {
        debug_assert!(valid_name(name), "label name {name:?}");
        if !self.0.is_empty() {
            self.0.push(',');
        }
        self.0.push_str(name);
        self.0.push_str("=\"");
        for c in value.chars() {
            match c {
                '\\' => self.0.push_str("\\\\"),
                '"' => self.0.push_str("\\\""),
                '\n' => self.0.push_str("\\n"),
                c => self.0.push(c),
            }
        }
        self.0.push('"');
    }
}

/// Whether `name` is a valid metric or label name (`[a-zA-Z_][a-zA-Z0-9_]*`).
fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A sample's value.
pub trait Value {
    fn write_to(&self, out: &mut String);
}

impl Value for u64 {
    fn write_to(&self, out: &mut String) {
        let _ = write!(out, "{self}");
    }
}

impl Value for f64 {
    fn write_to(&self, out: &mut String) {
        if self.is_nan() {
            out.push_str("NaN");
        } else if self.is_infinite() {
            out.push_str(if *self > 0.0 { "+Inf" } else { "-Inf" });
        } else {
            let _ = write!(out, "{self}");
        }
    }
}

/// Writes families and their samples in one format.
pub struct Writer {
    out: String,
    format: Format,
    /// The sample name of the family being written.
    sample_name: String,
    #[cfg(debug_assertions)]
    seen: std::collections::HashSet<String>,
}

impl Writer {
    pub fn new(format: Format) -> Writer {
        Writer {
            out: String::with_capacity(64 << 10),
            format,
            sample_name: String::new(),
            #[cfg(debug_assertions)]
            seen: Default::default(),
        }
    }

    /// Starts a family: `name` without the `_total` a counter's samples carry.
    pub fn family(&mut self, name: &str, kind: Kind, help: &str) {
        debug_assert!(valid_name(name) && !name.ends_with("_total"), "family name {name:?}");
        #[cfg(debug_assertions)]
        assert!(self.seen.insert(name.to_string()), "family {name} written twice");
        self.sample_name.clear();
        self.sample_name.push_str(name);
        if kind == Kind::Counter {
            self.sample_name.push_str("_total");
        }
        let (described, kind_name) = match (self.format, kind) {
            (Format::Text, Kind::Counter) => (self.sample_name.as_str(), "counter"),
            (_, Kind::Counter) => (name, "counter"),
            (_, Kind::Gauge) => (name, "gauge"),
        };
        let _ = write!(self.out, "# HELP {described} ");
        for c in help.chars() {
            match c {
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '"' if self.format == Format::OpenMetrics => self.out.push_str("\\\""),
                c => self.out.push(c),
            }
        }
        let _ = writeln!(self.out, "\n# TYPE {described} {kind_name}");
    }

    /// One sample of the current family.
    pub fn sample(&mut self, labels: &Labels, value: impl Value) {
        debug_assert!(!self.sample_name.is_empty(), "a sample before its family");
        self.out.push_str(&self.sample_name);
        if !labels.0.is_empty() {
            self.out.push('{');
            self.out.push_str(&labels.0);
            self.out.push('}');
        }
        self.out.push(' ');
        value.write_to(&mut self.out);
        self.out.push('\n');
    }

    /// The whole exposition.
    pub fn finish(mut self) -> String {
        if self.format == Format::OpenMetrics {
            self.out.push_str("# EOF\n");
        }
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn both(f: impl Fn(&mut Writer)) -> (String, String) {
        let mut text = Writer::new(Format::Text);
        let mut om = Writer::new(Format::OpenMetrics);
        f(&mut text);
        f(&mut om);
        (text.finish(), om.finish())
    }

    #[test]
    fn a_counter_is_named_with_total_in_text_and_without_in_openmetrics_descriptors() {
        let (text, om) = both(|w| {
            w.family("tidepool_released_bytes", Kind::Counter, "Bytes given back.");
            w.sample(&Labels::new(&[("reason", "oom")]), 5u64);
        });
        assert_eq!(
            text,
            "# HELP tidepool_released_bytes_total Bytes given back.\n# TYPE tidepool_released_bytes_total counter\n\
             tidepool_released_bytes_total{reason=\"oom\"} 5\n"
        );
        assert_eq!(
            om,
            "# HELP tidepool_released_bytes Bytes given back.\n# TYPE tidepool_released_bytes counter\n\
             tidepool_released_bytes_total{reason=\"oom\"} 5\n# EOF\n"
        );
    }

    #[test]
    fn label_values_and_help_are_escaped() {
        let labels = Labels::new(&[("comm", "a\"b\\c\nd")]);
        let (text, om) = both(|w| {
            w.family("tidepool_x", Kind::Gauge, "say \"hi\" \\ now\nplease");
            w.sample(&labels, 0.25f64);
            w.sample(&Labels::default(), f64::NAN);
        });
        assert!(text.contains(r#"tidepool_x{comm="a\"b\\c\nd"} 0.25"#), "{text}");
        assert!(text.contains(r#"# HELP tidepool_x say "hi" \\ now\nplease"#), "{text}");
        assert!(om.contains(r#"# HELP tidepool_x say \"hi\" \\ now\nplease"#), "{om}");
        assert!(text.contains("tidepool_x NaN\n"));
        assert_eq!(text.lines().count(), 4, "no raw newline escapes into the output");
    }

    #[test]
    fn the_accept_header_picks_openmetrics_only_when_preferred() {
        let prometheus_2 = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,\
                            text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(Format::negotiate(Some(prometheus_2)), Format::OpenMetrics);
        assert_eq!(Format::negotiate(None), Format::Text);
        assert_eq!(Format::negotiate(Some("*/*")), Format::Text);
        assert_eq!(Format::negotiate(Some("text/plain;version=0.0.4")), Format::Text);
        assert_eq!(Format::negotiate(Some("text/plain;q=0.9, application/openmetrics-text;q=0.5")), Format::Text);
        assert_eq!(Format::negotiate(Some("application/openmetrics-text; version=1.0.0; charset=utf-8")), Format::OpenMetrics);
        assert_eq!(Format::negotiate(Some("application/openmetrics-text;q=0")), Format::Text);
        assert_eq!(Format::negotiate(Some("application/openmetrics-text;q=garbage")), Format::Text);
    }
}
