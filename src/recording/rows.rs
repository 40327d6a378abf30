//! The rows of a recording, in RAPIDS RMM's logging CSV
//! (`Thread,Time,Action,Pointer,Size,Stream`), formatted fast enough for a
//! live process's every allocation and free. `trace::rmm_csv` reads them.
#![forbid(unsafe_code)]

pub const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

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
        RowWriter {
            prefix_of: None,
            prefix: Piece::default(),
            suffix_of: None,
            suffix: Piece::default(),
            recent: vec![zero; 1 << RECENT_BITS].into(),
        }
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
}
