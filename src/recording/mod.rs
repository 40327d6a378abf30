//! Recording (`TIDEPOOL_TRACE=<path>`): every allocation and free a process
//! serves, written as RMM's logging CSV so it replays here and in RMM's tools.
//!
//! Rows go into a buffer of the device heap while its lock is held anyway
//! (a few stores, no extra synchronisation); a full buffer is handed to a
//! writer thread, which does the formatting and the I/O off the lock, and
//! hands the emptied buffer back. At most `BUFFERS` buffers exist: when the
//! writer falls behind, the allocating thread waits for it, so memory stays
//! bounded whatever the allocation rate. The clock is read once every
//! `CLOCK_EVERY` rows (reading it costs more than the rest of a row), so a
//! row's time is that of a recent read.
#![forbid(unsafe_code)]

pub mod rows;

use std::cell::Cell;
use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crate::sync::Mutex;

use rows::{Action, Row, RowWriter, HEADER};

/// Rows a heap buffers before handing them to the writer (a multiple of `CLOCK_EVERY`).
const BUFFER_ROWS: usize = 4096;
/// Buffers in circulation between the heaps and the writer.
const BUFFERS: usize = 16;
/// Rows between two reads of the clock.
const CLOCK_EVERY: usize = 64;

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
pub(crate) struct Recorder {
    start: Instant,
    /// Full buffers to the writer.
    sender: Mutex<Option<SyncSender<Vec<Row>>>>,
    /// Empty buffers back from the writer.
    empties: Mutex<Receiver<Vec<Row>>>,
    writer: Mutex<Option<JoinHandle<std::io::Result<()>>>>,
}

impl Recorder {
    /// Creates `path` (truncating it), writes the header and starts the writer.
    pub fn create(path: &Path) -> std::io::Result<Arc<Recorder>> {
        let mut out = File::create(path)?;
        writeln!(out, "{HEADER}")?;
        let (sender, full) = sync_channel::<Vec<Row>>(BUFFERS);
        let (give_back, empties) = sync_channel::<Vec<Row>>(BUFFERS);
        for _ in 0..BUFFERS - 1 {
            give_back.send(Vec::with_capacity(BUFFER_ROWS)).expect("room for every buffer");
        }
        let writer = std::thread::Builder::new().name("tidepool-trace".into()).spawn(move || {
            let mut text = Vec::new();
            let mut formatter = RowWriter::default();
            // Bytes of whole rows in the file; after a failed write, the
            // rows that could not be written (the file is cut back to the
            // last whole row, so that it still reads as a trace).
            let mut whole = (HEADER.len() + 1) as u64;
            let mut failed: Option<(std::io::Error, u64)> = None;
            for mut rows in full {
                if let Some((_, lost)) = &mut failed {
                    *lost += rows.len() as u64;
                } else {
                    let batch = formatter.format(&rows, &mut text);
                    match out.write_all(batch) {
                        Ok(()) => whole += batch.len() as u64,
                        Err(err) => {
                            let _ = out.set_len(whole);
                            failed = Some((err, rows.len() as u64));
                        }
                    }
                }
                rows.clear();
                let _ = give_back.try_send(rows);
            }
            match failed {
                None => Ok(()),
                Some((err, lost)) => Err(std::io::Error::new(
                    err.kind(),
                    format!("{err}: the trace ends at the last whole row, {lost} rows after it were not written"),
                )),
            }
        })?;
        Ok(Arc::new(Recorder {
            start: Instant::now(),
            sender: Mutex::new(Some(sender)),
            empties: Mutex::new(empties),
            writer: Mutex::new(Some(writer)),
        }))
    }

    /// Hands `rows` to the writer and returns an empty buffer (waiting for
    /// one if the writer is behind).
    fn exchange(&self, rows: Vec<Row>) -> Vec<Row> {
        let sent = match self.sender.lock().as_ref() {
            Some(sender) => sender.send(rows).is_ok(),
            None => false,
        };
        if sent {
            if let Ok(empty) = self.empties.lock().recv() {
                return empty;
            }
        }
        Vec::with_capacity(BUFFER_ROWS)
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
pub(crate) struct TraceBuffer {
    recorder: Arc<Recorder>,
    rows: Vec<Row>,
    micros: u64,
}

impl TraceBuffer {
    pub fn new(recorder: Arc<Recorder>) -> TraceBuffer {
        TraceBuffer { recorder, rows: Vec::with_capacity(BUFFER_ROWS), micros: 0 }
    }

    /// Buffers a row: on the allocation path, so a few stores and one test.
    #[inline(always)]
    pub fn push(&mut self, action: Action, pointer: u64, size: u64, stream: u64) {
        if self.rows.len().is_multiple_of(CLOCK_EVERY) {
            self.tick();
        }
        self.rows.push(Row { thread: thread_number(), micros: self.micros, action, pointer, size, stream });
    }

    /// Every `CLOCK_EVERY` rows: hands a full buffer to the writer, and reads the clock.
    #[cold]
    #[inline(never)]
    fn tick(&mut self) {
        if self.rows.len() == BUFFER_ROWS {
            self.flush();
        }
        self.micros = self.recorder.start.elapsed().as_micros() as u64;
    }

    /// Hands the buffered rows to the writer.
    pub fn flush(&mut self) {
        if !self.rows.is_empty() {
            let rows = std::mem::take(&mut self.rows);
            self.rows = self.recorder.exchange(rows);
        }
    }
}

impl Drop for TraceBuffer {
    fn drop(&mut self) {
        self.flush();
    }
}
