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

/// Formats rows by hand: a recording writes tens of millions of rows, and
/// formatting them is what limits its rate. A row is four pieces of text:
/// "thread,time," (the same for runs of rows: a recording reads its clock
/// once every few dozen rows), "action,", "0xpointer,size" and ",stream\n"
/// (most rows name one stream). Each is kept formatted while it repeats;
/// "pointer,size" is looked up among recent ones (a free repeats its
/// allocation's, and a caching allocator hands the same blocks out again
/// and again). Pieces are copied whole, at a fixed size, into a buffer kept
/// at its full length, so a row costs a few copies and no length checks.
pub struct RowWriter {
    prefix_of: Option<(u64, u64)>,
    prefix: Piece,
    suffix_of: Option<u64>,
    suffix: Piece,
    /// (pointer, size, "0xpointer,size") by a hash of pointer and size.
    recent: Box<[(u64, u64, Piece)]>,
}

/// Entries of `RowWriter::recent`: 1024 (a power of two).
const RECENT_BITS: u32 = 10;

/// The most a row takes in the buffer: its four pieces, each copied whole.
const ROW_ROOM: usize = 4 * PIECE;

impl Default for RowWriter {
    fn default() -> Self {
        let zero = (0, 0, Piece::pointer_size(0, 0));
        RowWriter { prefix_of: None, prefix: Piece::default(), suffix_of: None, suffix: Piece::default(), recent: vec![zero; 1 << RECENT_BITS].into() }
    }
}

impl RowWriter {
    /// Formats `rows` into `buffer` (reused from call to call: it keeps its
    /// length) and returns the text.
    pub fn format<'a>(&mut self, rows: &[Row], buffer: &'a mut Vec<u8>) -> &'a [u8] {
        let room = rows.len() * ROW_ROOM;
        if buffer.len() < room {
            buffer.resize(room, 0);
        }
        let mut at = 0;
        for row in rows {
            at = self.write(buffer, at, row);
        }
        &buffer[..at]
    }

    /// Writes `row` at `at` in `buffer`, which has room for it; returns where it ends.
    #[inline(always)]
    fn write(&mut self, buffer: &mut [u8], at: usize, row: &Row) -> usize {
        if self.prefix_of != Some((row.thread, row.micros)) {
            self.prefix = Piece::prefix(row.thread, row.micros);
            self.prefix_of = Some((row.thread, row.micros));
        }
        if self.suffix_of != Some(row.stream) {
            self.suffix = Piece::suffix(row.stream);
            self.suffix_of = Some(row.stream);
        }
        let action = match row.action {
            Action::Allocate => &ALLOCATE,
            Action::Free => &FREE,
            Action::AllocateFailure => &ALLOCATE_FAILURE,
        };
        let key = (row.pointer ^ row.size.rotate_left(32)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - RECENT_BITS);
        let entry = &mut self.recent[key as usize];
        if (entry.0, entry.1) != (row.pointer, row.size) {
            *entry = (row.pointer, row.size, Piece::pointer_size(row.pointer, row.size));
        }
        let at = self.prefix.put(buffer, at);
        let at = action.put(buffer, at);
        let at = entry.2.put(buffer, at);
        self.suffix.put(buffer, at)
    }
}

/// The room of a piece of text.
const PIECE: usize = 48;

/// Up to `PIECE` bytes of text, copied whole wherever it goes.
#[derive(Clone, Copy)]
struct Piece {
    bytes: [u8; PIECE],
    len: usize,
}

impl Default for Piece {
    fn default() -> Self {
        Piece { bytes: [0; PIECE], len: 0 }
    }
}

impl Piece {
    /// For constants (a const fn copies byte by byte).
    const fn new(text: &[u8]) -> Piece {
        let mut bytes = [0; PIECE];
        let mut i = 0;
        while i < text.len() {
            bytes[i] = text[i];
            i += 1;
        }
        Piece { bytes, len: text.len() }
    }

    fn from(text: &[u8]) -> Piece {
        let mut piece = Piece::default();
        piece.bytes[..text.len()].copy_from_slice(text);
        piece.len = text.len();
        piece
    }

    /// "thread,hh:mm:ss.micros," (hours grow past two digits if need be):
    /// at most 20 + 1 + 10 + 13 + 1 bytes.
    fn prefix(thread: u64, micros: u64) -> Piece {
        let secs = micros / 1_000_000;
        let text = format!("{thread},{:02}:{:02}:{:02}.{:06},", secs / 3600, secs / 60 % 60, secs % 60, micros % 1_000_000);
        Piece::from(text.as_bytes())
    }

    /// "0xpointer,size": at most 18 + 1 + 20 bytes. By hand, from the
    /// right: a recording of a workload with many block sizes makes one
    /// every few rows.
    fn pointer_size(pointer: u64, size: u64) -> Piece {
        let mut text = [0u8; 40];
        let mut at = text.len();
        let mut value = size;
        while value >= 100 {
            let pair = (value % 100) as usize * 2;
            value /= 100;
            at -= 2;
            text[at..at + 2].copy_from_slice(&DIGIT_PAIRS[pair..pair + 2]);
        }
        if value >= 10 {
            at -= 2;
            text[at..at + 2].copy_from_slice(&DIGIT_PAIRS[value as usize * 2..value as usize * 2 + 2]);
        } else {
            at -= 1;
            text[at] = b'0' + value as u8;
        }
        at -= 1;
        text[at] = b',';
        let mut value = pointer;
        loop {
            at -= 1;
            text[at] = b"0123456789abcdef"[(value & 0xf) as usize];
            value >>= 4;
            if value == 0 {
                break;
            }
        }
        at -= 2;
        text[at..at + 2].copy_from_slice(b"0x");
        Piece::from(&text[at..])
    }

    /// ",stream\n", the stream in hex.
    fn suffix(stream: u64) -> Piece {
        Piece::from(format!(",{stream:x}\n").as_bytes())
    }

    /// Copies the piece to `at` in `buffer`; returns where its text ends.
    #[inline(always)]
    fn put(&self, buffer: &mut [u8], at: usize) -> usize {
        buffer[at..at + PIECE].copy_from_slice(&self.bytes);
        at + self.len
    }
}

/// The decimal digits of 0 to 99, two by two.
const DIGIT_PAIRS: &[u8; 200] = b"\
    0001020304050607080910111213141516171819\
    2021222324252627282930313233343536373839\
    4041424344454647484950515253545556575859\
    6061626364656667686970717273747576777879\
    8081828384858687888990919293949596979899";

const ALLOCATE: Piece = Piece::new(b"allocate,");
const FREE: Piece = Piece::new(b"free,");
const ALLOCATE_FAILURE: Piece = Piece::new(b"allocate failure,");

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
    fn the_row_writer_writes_what_format_writes() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let edges = [0, 1, 9, 10, 15, 16, 99, 100, 255, 256, 999_999, 1 << 32, u64::MAX / 10, u64::MAX];
        let mut rows = Vec::new();
        for i in 0..20_000usize {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let pick = |shift: u32| if i % 3 == 0 { edges[(x >> shift) as usize % edges.len()] } else { x >> (x >> shift & 63) };
            let (pointer, size, stream, micros) = (pick(1), pick(9), pick(17), pick(25) % (1 << 40));
            let action = [Action::Allocate, Action::Free, Action::AllocateFailure][i % 3];
            rows.push(Row { thread: (x & 0xff) + 1, micros, action, pointer, size, stream });
            // Repeats, as recordings have them: the same block again, the same time and stream.
            if i % 5 == 0 {
                rows.push(Row { thread: rows[i / 2].thread, micros, action: Action::Free, ..rows[i / 2] });
            }
        }
        let mut expected = String::new();
        for row in &rows {
            let name = match row.action {
                Action::Allocate => "allocate",
                Action::Free => "free",
                Action::AllocateFailure => "allocate failure",
            };
            let secs = row.micros / 1_000_000;
            let (h, m, s, us) = (secs / 3600, secs / 60 % 60, secs % 60, row.micros % 1_000_000);
            let (thread, pointer, size, stream) = (row.thread, row.pointer, row.size, row.stream);
            expected += &format!("{thread},{h:02}:{m:02}:{s:02}.{us:06},{name},{pointer:#x},{size},{stream:x}\n");
        }
        let (mut writer, mut buffer, mut text) = (RowWriter::default(), Vec::new(), Vec::new());
        for batch in rows.chunks(777) {
            text.extend_from_slice(writer.format(batch, &mut buffer));
        }
        assert_eq!(String::from_utf8(text).unwrap(), expected);
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
