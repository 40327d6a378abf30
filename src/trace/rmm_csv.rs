//! RAPIDS RMM's logging CSV: `Thread,Time,Action,Pointer,Size,Stream`, one
//! row per `allocate`, `free` or `allocate failure`. Pointers are hex with
//! `0x`, streams hex without, times `HH:MM:SS.ffffff`. tidepool reads these
//! logs and writes its own recordings in the same format, so traces move
//! between the two tools.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};

use super::{Format, Trace, TraceError};

pub const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";
/// A longer line is not RMM's CSV: refuse it rather than buffer it.
const MAX_LINE: usize = 4096;

/// Reads an RMM CSV log. Rows that cannot be replayed (a free of a pointer
/// never allocated, a reallocation of a live pointer) become counted warnings.
pub fn read(input: impl Read, file: &str) -> Result<Trace, TraceError> {
    let mut reader = BufReader::new(input);
    let mut trace = Trace::new(file, Format::RmmCsv);
    let mut live: HashMap<u64, u32> = HashMap::new();
    let mut line = Vec::new();
    let mut columns: Option<[usize; 4]> = None;
    for number in 1.. {
        let error = |message: String| TraceError { file: file.to_string(), location: format!("line {number}"), message };
        line.clear();
        let n = (&mut reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| error(format!("read error: {e}")))?;
        if n == 0 {
            break;
        }
        if line.len() > MAX_LINE && !line.ends_with(b"\n") {
            return Err(error(format!("longer than {MAX_LINE} bytes: not an RMM log")));
        }
        let text = std::str::from_utf8(&line).map_err(|_| error("not UTF-8 text: not an RMM log".into()))?;
        let text = text.trim_end_matches(['\n', '\r']);
        if text.trim().is_empty() {
            continue;
        }
        let fields: Vec<&str> = text.split(',').map(str::trim).collect();
        let Some([action_at, pointer_at, size_at, stream_at]) = columns else {
            let find = |name: &str| fields.iter().position(|f| f.eq_ignore_ascii_case(name));
            match (find("Action"), find("Pointer"), find("Size"), find("Stream")) {
                (Some(a), Some(p), Some(s), Some(st)) => columns = Some([a, p, s, st]),
                _ => return Err(error(format!("expected the header {HEADER:?}, found {text:?}"))),
            }
            continue;
        };
        let field = |at: usize| fields.get(at).copied().ok_or_else(|| error(format!("missing column {}", at + 1)));
        let action = field(action_at)?;
        if action == "allocate failure" {
            trace.warnings.add(format!("line {number}: allocate failure in the log (not replayed)"));
            continue;
        }
        let pointer = parse_hex(field(pointer_at)?).ok_or_else(|| error(format!("bad pointer {:?}", field(pointer_at).unwrap_or(""))))?;
        match action {
            "allocate" => {
                let size_text = field(size_at)?;
                let size: u64 = size_text.parse().map_err(|_| error(format!("bad size {size_text:?}")))?;
                let stream_text = field(stream_at)?;
                let stream = parse_hex(stream_text).ok_or_else(|| error(format!("bad stream {stream_text:?}")))?;
                if let Some(old) = live.remove(&pointer) {
                    trace.warnings.add(format!("line {number}: {pointer:#x} allocated while live; the old one is freed"));
                    trace.free(old);
                }
                let id = trace.alloc(size, stream, 0);
                live.insert(pointer, id);
            }
            "free" => match live.remove(&pointer) {
                Some(id) => trace.free(id),
                None => trace.warnings.add(format!("line {number}: free of {pointer:#x}, which is not live (skipped)")),
            },
            other => return Err(error(format!("unknown action {other:?}"))),
        }
    }
    if columns.is_none() {
        return Err(TraceError { file: file.to_string(), location: String::new(), message: "no header: not an RMM log".into() });
    }
    Ok(trace)
}

fn parse_hex(text: &str) -> Option<u64> {
    let digits = text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")).unwrap_or(text);
    u64::from_str_radix(digits, 16).ok()
}

/// One row of a log being written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    pub thread: u64,
    /// Microseconds since the recording started.
    pub micros: u64,
    pub action: Action,
    pub pointer: u64,
    pub size: u64,
    pub stream: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Allocate,
    Free,
    AllocateFailure,
}

/// Writes one row in RMM's format.
pub fn write_row(out: &mut Vec<u8>, row: &Row) -> std::io::Result<()> {
    RowWriter::default().write(out, row);
    Ok(())
}

/// Formats rows by hand, reusing the "thread,time," prefix while it stays
/// the same (a recording reads its clock once every few dozen rows): a
/// recording writes millions of rows and formatting is its bottleneck.
#[derive(Default)]
pub struct RowWriter {
    prefix_of: Option<(u64, u64)>,
    prefix: Line,
}

impl RowWriter {
    pub fn write(&mut self, out: &mut Vec<u8>, row: &Row) {
        if self.prefix_of != Some((row.thread, row.micros)) {
            let secs = row.micros / 1_000_000;
            let p = &mut self.prefix;
            p.len = 0;
            p.decimal(row.thread, 1);
            p.push(b",");
            p.decimal(secs / 3600, 2);
            p.push(b":");
            p.decimal(secs / 60 % 60, 2);
            p.push(b":");
            p.decimal(secs % 60, 2);
            p.push(b".");
            p.decimal(row.micros % 1_000_000, 6);
            p.push(b",");
            self.prefix_of = Some((row.thread, row.micros));
        }
        let action: &[u8] = match row.action {
            Action::Allocate => b"allocate,0x",
            Action::Free => b"free,0x",
            Action::AllocateFailure => b"allocate failure,0x",
        };
        let mut line = Line::default();
        line.push(&self.prefix.bytes[..self.prefix.len]);
        line.push(action);
        line.hex(row.pointer);
        line.push(b",");
        line.decimal(row.size, 1);
        line.push(b",");
        line.hex(row.stream);
        line.push(b"\n");
        out.extend_from_slice(&line.bytes[..line.len]);
    }
}

/// A row being formatted: at most 20 + 16 + 19 + 16 + 20 + 16 + 5 bytes.
struct Line {
    bytes: [u8; 128],
    len: usize,
}

impl Default for Line {
    fn default() -> Self {
        Line { bytes: [0; 128], len: 0 }
    }
}

impl Line {
    #[inline]
    fn push(&mut self, text: &[u8]) {
        self.bytes[self.len..self.len + text.len()].copy_from_slice(text);
        self.len += text.len();
    }

    /// `value` in decimal, zero-padded to `width` digits.
    #[inline]
    fn decimal(&mut self, mut value: u64, width: usize) {
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        while value > 0 || digits.len() - at < width {
            at -= 1;
            digits[at] = b'0' + (value % 10) as u8;
            value /= 10;
        }
        self.push(&digits[at..]);
    }

    /// `value` in lower-case hex without prefix.
    #[inline]
    fn hex(&mut self, value: u64) {
        let n = (64 - value.leading_zeros() as usize).div_ceil(4).max(1);
        for i in (0..n).rev() {
            self.bytes[self.len] = b"0123456789abcdef"[(value >> (4 * i)) as usize & 0xf];
            self.len += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Event;

    fn read_str(text: &str) -> Result<Trace, TraceError> {
        read(text.as_bytes(), "test.csv")
    }

    #[test]
    fn rows_become_allocations_and_frees() {
        let trace = read_str(
            "Thread,Time,Action,Pointer,Size,Stream\n\
             1,00:00:00.000001,allocate,0x1000,100,0\n\
             1,00:00:00.000002,allocate,0x2000,300,7f\n\
             1,00:00:00.000003,free,0x1000,100,0\n\
             1,00:00:00.000004,allocate failure,0x0,999999,0\n",
        )
        .unwrap();
        assert_eq!(
            trace.events,
            vec![
                Event::Alloc { id: 0, size: 100, stream: 0, device: 0 },
                Event::Alloc { id: 1, size: 300, stream: 0x7f, device: 0 },
                Event::Free { id: 0 },
            ]
        );
        assert_eq!(trace.peak_requested(), 400);
        assert_eq!(trace.warnings.count, 1);
    }

    #[test]
    fn a_free_of_an_unknown_pointer_is_a_counted_warning() {
        let trace = read_str("Thread,Time,Action,Pointer,Size,Stream\n1,0,free,0x55,8,0\n").unwrap();
        assert!(trace.events.is_empty());
        assert_eq!(trace.warnings.count, 1);
        assert!(trace.warnings.first[0].contains("line 2"), "{:?}", trace.warnings);
    }

    #[test]
    fn bad_files_name_the_line() {
        let err = read_str("hello,world\n").unwrap_err();
        assert_eq!((err.file.as_str(), err.location.as_str()), ("test.csv", "line 1"));
        assert!(err.message.contains("header"));
        let err = read_str("Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10,99999999999999999999999,0\n").unwrap_err();
        assert_eq!(err.location, "line 2");
        assert!(err.message.contains("bad size"));
        let err = read_str("Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,zz,1,0\n").unwrap_err();
        assert!(err.message.contains("bad pointer"));
        let err = read_str("Thread,Time,Action,Pointer,Size,Stream\n1,0,steal,0x1,1,0\n").unwrap_err();
        assert!(err.message.contains("unknown action"));
        assert!(read_str("").unwrap_err().message.contains("no header"));
        let long = format!("Thread,Time,Action,Pointer,Size,Stream\n{}\n", "9".repeat(10_000));
        assert!(read_str(&long).unwrap_err().message.contains("longer than"));
        assert!(read(&[0xff, 0xfe, b'\n'][..], "x").unwrap_err().message.contains("UTF-8"));
    }

    #[test]
    fn written_rows_read_back() {
        let mut out = Vec::new();
        out.extend_from_slice(HEADER.as_bytes());
        out.push(b'\n');
        let rows = [
            Row { thread: 3, micros: 3_723_000_001, action: Action::Allocate, pointer: 0x7f00_0000_0000, size: 4096, stream: 0x1f },
            Row { thread: 3, micros: 3_723_000_002, action: Action::Free, pointer: 0x7f00_0000_0000, size: 4096, stream: 0x1f },
        ];
        for row in &rows {
            write_row(&mut out, row).unwrap();
        }
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("3,01:02:03.000001,allocate,0x7f0000000000,4096,1f"), "{text}");
        let trace = read_str(&text).unwrap();
        assert_eq!(trace.events, vec![Event::Alloc { id: 0, size: 4096, stream: 0x1f, device: 0 }, Event::Free { id: 0 }]);
    }
}
