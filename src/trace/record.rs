//! Recording (`TIDEPOOL_TRACE=<path>`): every allocation and free a process
//! serves, written as RMM's logging CSV so it replays here and in RMM's tools.
//!
//! Rows go into a buffer of the device heap while its lock is held anyway
//! (a few stores, no extra synchronisation); a full buffer is handed to a
//! writer thread, which does the formatting and the I/O off the lock. The
//! clock is read once every `CLOCK_EVERY` rows (reading it costs more than
//! the rest of a row), so a row's time is that of a recent read.
#![forbid(unsafe_code)]

use std::cell::Cell;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::Mutex;

use super::rmm_csv::{write_row, Action, Row, HEADER};

/// Rows a heap buffers before handing them to the writer.
const BUFFER_ROWS: usize = 4096;
/// Rows between two reads of the clock.
const CLOCK_EVERY: u32 = 64;

static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// A small number naming this thread in the log (0: not yet given).
    static THREAD: Cell<u64> = const { Cell::new(0) };
}

fn thread_number() -> u64 {
    THREAD.with(|t| {
        if t.get() == 0 {
            t.set(NEXT_THREAD.fetch_add(1, Ordering::Relaxed));
        }
        t.get()
    })
}

/// One recording: the file and its writer thread.
pub struct Recorder {
    path: PathBuf,
    start: Instant,
    sender: Mutex<Option<Sender<Vec<Row>>>>,
    writer: Mutex<Option<JoinHandle<std::io::Result<()>>>>,
}

impl Recorder {
    /// Creates `path` (truncating it), writes the header and starts the writer.
    pub fn create(path: &Path) -> std::io::Result<Arc<Recorder>> {
        let mut out = BufWriter::with_capacity(1 << 16, File::create(path)?);
        writeln!(out, "{HEADER}")?;
        let (sender, receiver) = channel::<Vec<Row>>();
        let writer = std::thread::Builder::new().name("tidepool-trace".into()).spawn(move || {
            for rows in receiver {
                for row in &rows {
                    write_row(&mut out, row)?;
                }
            }
            out.flush()
        })?;
        Ok(Arc::new(Recorder {
            path: path.to_path_buf(),
            start: Instant::now(),
            sender: Mutex::new(Some(sender)),
            writer: Mutex::new(Some(writer)),
        }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn send(&self, rows: Vec<Row>) {
        if let Some(sender) = self.sender.lock().as_ref() {
            let _ = sender.send(rows);
        }
    }

    /// Stops the writer after it wrote everything sent; reports a write error.
    pub fn finish(&self) -> std::io::Result<()> {
        self.sender.lock().take();
        match self.writer.lock().take() {
            Some(handle) => handle.join().unwrap_or_else(|_| Err(std::io::Error::other("trace writer panicked"))),
            None => Ok(()),
        }
    }
}

/// The rows one heap has not yet handed to the writer.
pub struct TraceBuffer {
    recorder: Arc<Recorder>,
    rows: Vec<Row>,
    until_clock: u32,
    micros: u64,
}

impl TraceBuffer {
    pub fn new(recorder: Arc<Recorder>) -> TraceBuffer {
        TraceBuffer { recorder, rows: Vec::with_capacity(BUFFER_ROWS), until_clock: 0, micros: 0 }
    }

    #[inline]
    pub fn push(&mut self, action: Action, pointer: u64, size: u64, stream: u64) {
        if self.until_clock == 0 {
            self.micros = self.recorder.start.elapsed().as_micros() as u64;
            self.until_clock = CLOCK_EVERY;
        }
        self.until_clock -= 1;
        self.rows.push(Row { thread: thread_number(), micros: self.micros, action, pointer, size, stream });
        if self.rows.len() == BUFFER_ROWS {
            self.flush();
        }
    }

    /// Hands the buffered rows to the writer.
    pub fn flush(&mut self) {
        if !self.rows.is_empty() {
            let rows = std::mem::replace(&mut self.rows, Vec::with_capacity(BUFFER_ROWS));
            self.recorder.send(rows);
        }
    }
}

impl Drop for TraceBuffer {
    fn drop(&mut self) {
        self.flush();
    }
}
