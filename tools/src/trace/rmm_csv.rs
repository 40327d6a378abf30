//! RAPIDS RMM's logging CSV: `Thread,Time,Action,Pointer,Size,Stream`, one
//! row per `allocate`, `free` or `allocate failure`. Pointers are hex with
//! `0x`, streams hex without, times `HH:MM:SS.ffffff`. tidepool reads these
//! logs and writes its own recordings in the same format, so traces move
//! between the two tools. One action is tidepool's: `mark` names a point of
//! the trace (its label in an `Operator` column when there is one; the
//! planner marks each step's end), and allocates nothing.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};

use super::{Format, Trace, TraceError};

/// The row format is the recording's (`tidepool::recording::rows`); its names stay reachable here.
pub use tidepool::recording::rows::{Action, Row, RowWriter, HEADER};
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
    // The optional Operator column (tidepool's recordings have it): a mark's label.
    let mut operator_at: Option<usize> = None;
    for number in 1.. {
        let error = |message: String| TraceError { file: file.to_string(), location: format!("line {number}"), message };
        line.clear();
        let n = (&mut reader).take(MAX_LINE as u64 + 1).read_until(b'\n', &mut line).map_err(|e| error(format!("read error: {e}")))?;
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
                (Some(a), Some(p), Some(s), Some(st)) => (columns, operator_at) = (Some([a, p, s, st]), find("Operator")),
                _ => return Err(error(format!("expected the header {HEADER:?}, found {text:?}"))),
            }
            continue;
        };
        let field = |at: usize| fields.get(at).copied().ok_or_else(|| error(format!("missing column {}", at + 1)));
        let action = field(action_at)?;
        if action == "mark" {
            let operator = operator_at.and_then(|at| fields.get(at)).copied().unwrap_or("");
            trace.mark(operator);
            continue;
        }
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
        out.extend_from_slice(RowWriter::default().format(&rows, &mut Vec::new()));
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("3,01:02:03.000001,allocate,0x7f0000000000,4096,1f"), "{text}");
        let trace = read_str(&text).unwrap();
        assert_eq!(trace.events, vec![Event::Alloc { id: 0, size: 4096, stream: 0x1f, device: 0 }, Event::Free { id: 0 }]);
    }
}
