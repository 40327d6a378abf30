//! `tidepool exporter`'s HTTP server: `GET /metrics` (the scrape, in the
//! format the `Accept` header prefers) and `GET /` (a page linking to it);
//! 404 for other paths, 405 for other methods (HEAD is GET without a body).
//!
//! Bounds, so that no scraper, stray client or attacker can exhaust the
//! host or keep Prometheus waiting (the models: node_exporter's and
//! Prometheus's own handlers):
//! - connections are accepted at once and served concurrently; at most
//!   `max_connections` are open. A connection is idle while no request of
//!   it is in progress (connected and silent, sending its headers a byte at
//!   a time, or between two requests); when the bound is reached, the
//!   oldest idle one is closed to make room (the newcomer waits until its
//!   socket is closed: a closing connection still counts), and only when
//!   every open connection has a request in progress is the newcomer
//!   closed at once. Open files and memory are bounded by
//!   `max_connections` (plus the newcomer), whatever the clients do;
//! - a request's headers must arrive within `timeout` of the connection
//!   opening or of the previous response (a client that connects and sends
//!   nothing, or dribbles, is dropped then); headers larger than 16 KiB are
//!   refused; a connection lives at most `MAX_AGE_TIMEOUTS` timeouts, then
//!   closes after its current response, or at once if that takes one more;
//! - scrapes (file reads) run on at most two threads at once, the rest
//!   queue: memory stays flat however many clients scrape together.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use super::exposition::Format;
use super::Exporter;
use http_body_util::Full;
use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, ACCEPT, ALLOW, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify};

/// How many timeouts a connection may live.
const MAX_AGE_TIMEOUTS: u32 = 6;

pub struct ServeOptions {
    pub timeout: Duration,
    pub max_connections: usize,
}

const INDEX: &str = "<!DOCTYPE html>\n<html><head><title>tidepool exporter</title></head><body>\n\
<h1>tidepool exporter</h1>\n<p>The memory of every tidepool process on this host, per device: \
<a href=\"/metrics\">/metrics</a>.</p>\n</body></html>\n";

/// The open connections, oldest first (ids grow), with how many requests
/// of each are in progress and how to close it.
#[derive(Default)]
struct Connections {
    next: u64,
    open: BTreeMap<u64, Open>,
}

struct Open {
    /// Requests received whose response is not yet written.
    busy: u32,
    /// Closes the connection (its task drops it at once); `None` once
    /// sent: the connection is closing and still counts until its task
    /// has closed the socket.
    close: Option<oneshot::Sender<()>>,
}

/// What `make_room` found.
#[derive(Debug, PartialEq, Eq)]
enum Room {
    /// Fewer than the bound are open: the newcomer may be added.
    Free,
    /// Connections are closing to make room: wait until one has.
    Closing,
    /// Every open connection has a request in progress.
    Busy,
}

impl Connections {
    /// Room for one more connection under `max`. A connection closed to
    /// make room counts until its socket is closed (so open files never
    /// pass the bound): the oldest idle one is told to close, and the
    /// caller waits for it.
    fn make_room(&mut self, max: usize) -> Room {
        if self.open.len() < max {
            return Room::Free;
        }
        if self.open.values().any(|c| c.close.is_none()) {
            return Room::Closing;
        }
        let Some(oldest_idle) = self.open.values_mut().find(|c| c.busy == 0) else {
            return Room::Busy;
        };
        if let Some(close) = oldest_idle.close.take() {
            let _ = close.send(());
        }
        Room::Closing
    }

    fn add(&mut self, close: oneshot::Sender<()>) -> u64 {
        self.next += 1;
        self.open.insert(self.next, Open { busy: 0, close: Some(close) });
        self.next
    }

    fn busy(&mut self, id: u64, delta: i32) {
        if let Some(c) = self.open.get_mut(&id) {
            c.busy = c.busy.saturating_add_signed(delta);
        }
    }
}

/// The connections, shared by the accept loop and the connections' tasks,
/// and the accept loop's wake-up when one has closed.
#[derive(Default)]
struct Shared {
    connections: Mutex<Connections>,
    one_closed: Notify,
}

impl Shared {
    fn lock(&self) -> parking_lot::MutexGuard<'_, Connections> {
        self.connections.lock()
    }
}

/// Forgets connection `id` when its task ends, however it ends (after its
/// socket is closed).
struct Registered(Arc<Shared>, u64);

impl Drop for Registered {
    fn drop(&mut self) {
        self.0.lock().open.remove(&self.1);
        self.0.one_closed.notify_one();
    }
}

/// A response body that keeps its connection busy until it is written
/// (hyper drops the body once sent, or when the connection goes).
struct Tracked {
    body: Full<Bytes>,
    connections: Arc<Shared>,
    id: u64,
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.connections.lock().busy(self.id, -1);
    }
}

/// Serves until the process ends; returns only if the runtime cannot start.
pub fn serve(exporter: Arc<Exporter>, listener: TcpListener, options: ServeOptions) -> Result<(), String> {
    listener.set_nonblocking(true).map_err(|e| format!("listener: {e}"))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(2)
        .thread_name("tidepool-exporter")
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the server's runtime: {e}"))?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| format!("listener: {e}"))?;
        let connections: Arc<Shared> = Arc::default();
        let max = options.max_connections.max(1);
        'accept: loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(err) => {
                    // Out of file descriptors, say: wait rather than spin.
                    eprintln!("tidepool exporter: accept: {err}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (close, closed) = oneshot::channel();
            let id = loop {
                let one_closed = connections.one_closed.notified();
                {
                    let mut open = connections.lock();
                    match open.make_room(max) {
                        Room::Free => break open.add(close),
                        Room::Busy => continue 'accept, // every connection has a request in progress: this one is closed
                        Room::Closing => {}
                    }
                }
                one_closed.await;
            };
            let (exporter, connections, timeout) = (exporter.clone(), connections.clone(), options.timeout);
            tokio::spawn(serve_connection(stream, exporter, Registered(connections, id), closed, timeout));
        }
    })
}

/// Serves one connection until it ends, is closed to make room (`closed`)
/// or has lived `MAX_AGE_TIMEOUTS` timeouts.
async fn serve_connection(
    stream: tokio::net::TcpStream,
    exporter: Arc<Exporter>,
    registered: Registered,
    closed: oneshot::Receiver<()>,
    timeout: Duration,
) {
    let (connections, id) = (registered.0.clone(), registered.1);
    let service = service_fn(move |request| {
        connections.lock().busy(id, 1);
        let (exporter, connections) = (exporter.clone(), connections.clone());
        async move {
            let response = respond(exporter, request).await?;
            Ok::<_, std::convert::Infallible>(response.map(|body| Tracked { body, connections, id }))
        }
    });
    let mut builder = http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(timeout).max_buf_size(16 << 10);
    {
        let mut connection = std::pin::pin!(builder.serve_connection(TokioIo::new(stream), service));
        tokio::select! {
            _ = closed => {}
            lived = tokio::time::timeout(timeout * MAX_AGE_TIMEOUTS, connection.as_mut()) => {
                if lived.is_err() {
                    connection.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(timeout, connection).await;
                }
            }
        }
    } // the socket is closed here, before the connection stops counting
    drop(registered);
}

async fn respond(exporter: Arc<Exporter>, request: Request<Incoming>) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let head = request.method() == Method::HEAD;
    if request.method() != Method::GET && !head {
        let mut response = plain(StatusCode::METHOD_NOT_ALLOWED, "405 method not allowed: GET /metrics\n");
        response.headers_mut().insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return Ok(response);
    }
    let response = match request.uri().path() {
        "/metrics" => {
            let accept = request.headers().get(ACCEPT).and_then(|v| v.to_str().ok());
            let format = Format::negotiate(accept);
            match tokio::task::spawn_blocking(move || exporter.scrape(format)).await {
                Ok(text) => {
                    let mut response = Response::new(Full::new(Bytes::from(text)));
                    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(format.content_type()));
                    response
                }
                Err(_) => plain(StatusCode::INTERNAL_SERVER_ERROR, "500 the scrape failed\n"),
            }
        }
        "/" => {
            let mut response = Response::new(Full::new(Bytes::from_static(INDEX.as_bytes())));
            response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
            response
        }
        _ => plain(StatusCode::NOT_FOUND, "404 not found: the metrics are at /metrics\n"),
    };
    // hyper sends no body for HEAD (the Content-Length stays GET's).
    Ok(response)
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_open(count: usize) -> (Connections, Vec<oneshot::Receiver<()>>) {
        let mut open = Connections::default();
        let receivers = (0..count)
            .map(|_| {
                let (close, closed) = oneshot::channel();
                open.add(close);
                closed
            })
            .collect();
        (open, receivers)
    }

    #[test]
    fn a_connection_closed_to_make_room_counts_until_its_task_forgets_it() {
        let (mut open, mut closed) = with_open(3);
        assert_eq!(open.make_room(4), Room::Free);
        open.busy(1, 1);
        // At the bound: the oldest idle one (2, as 1 is busy) is told to close.
        assert_eq!(open.make_room(3), Room::Closing);
        assert!(closed[0].try_recv().is_err(), "a busy connection is not closed");
        assert_eq!(closed[1].try_recv(), Ok(()));
        assert!(closed[2].try_recv().is_err());
        // Until its task has closed the socket it still counts, and no other is closed.
        assert_eq!(open.open.len(), 3);
        assert_eq!(open.make_room(3), Room::Closing);
        assert!(closed[2].try_recv().is_err(), "one closing is enough");
        open.open.remove(&2);
        assert_eq!(open.make_room(3), Room::Free);
    }

    #[test]
    fn the_newcomer_is_refused_only_while_every_connection_is_busy() {
        let (mut open, _closed) = with_open(2);
        open.busy(1, 1);
        open.busy(2, 1);
        assert_eq!(open.make_room(2), Room::Busy);
        open.busy(2, -1);
        assert_eq!(open.make_room(2), Room::Closing);
    }
}
