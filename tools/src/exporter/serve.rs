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
//!   oldest idle one is closed to make room, and only when every open
//!   connection has a request in progress is the newcomer closed at once.
//!   Open files and memory are bounded by `max_connections`, whatever the
//!   clients do;
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
use tokio::sync::oneshot;

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
    /// Closes the connection (its task drops it at once).
    close: Option<oneshot::Sender<()>>,
}

impl Connections {
    /// Room for one more connection under `max`: the oldest idle one is
    /// closed if need be. False when every open one is busy.
    fn make_room(&mut self, max: usize) -> bool {
        while self.open.len() >= max {
            let Some(oldest_idle) = self.open.iter().find(|(_, c)| c.busy == 0).map(|(&id, _)| id) else {
                return false;
            };
            if let Some(close) = self.open.remove(&oldest_idle).and_then(|mut c| c.close.take()) {
                let _ = close.send(());
            }
        }
        true
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

/// The connections, shared by the accept loop and the connections' tasks.
type Shared = Arc<Mutex<Connections>>;

/// Forgets connection `id` when its task ends, however it ends.
struct Registered(Shared, u64);

impl Drop for Registered {
    fn drop(&mut self) {
        self.0.lock().open.remove(&self.1);
    }
}

/// A response body that keeps its connection busy until it is written
/// (hyper drops the body once sent, or when the connection goes).
struct Tracked {
    body: Full<Bytes>,
    connections: Shared,
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
        let connections: Shared = Arc::default();
        let max = options.max_connections.max(1);
        loop {
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
            let id = {
                let mut open = connections.lock();
                if !open.make_room(max) {
                    continue; // every connection has a request in progress: this one is closed
                }
                open.add(close)
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
