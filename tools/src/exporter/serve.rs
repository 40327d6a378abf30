//! `tidepool exporter`'s HTTP server: `GET /metrics` (the scrape, in the
//! format the `Accept` header prefers) and `GET /` (a page linking to it);
//! 404 for other paths, 405 for other methods (HEAD is GET without a body).
//!
//! Bounds, so that no scraper, stray client or attacker can exhaust the
//! host or keep Prometheus waiting (the models: node_exporter's and
//! Prometheus's own handlers):
//! - connections are accepted at once and served concurrently; at most
//!   `max_connections` are open. A connection is idle while no request of
//!   it is in progress and none waits unread in its socket (connected and
//!   silent, sending its headers a byte at a time, between two requests,
//!   or closed by its client after part of a request); when the bound is
//!   reached, the oldest idle one is closed to make room (the newcomer
//!   waits until its socket is closed: a closing connection still counts),
//!   and only when every open connection has a request in progress or
//!   waiting is the newcomer closed at once. Whether a request waits is
//!   read from the socket itself (a peek: the end of a request's head in
//!   the bytes not yet read, after those read last), so a scraper whose
//!   request has arrived but not yet been read is never the one closed.
//!   Open files and memory are bounded by `max_connections` (plus the
//!   newcomer), whatever the clients do;
//! - the listen queue is asked for `LISTEN_BACKLOG` connects: a flood of
//!   connects waits there while the accept loop catches up, instead of
//!   being dropped by the kernel (a dropped connect is sent again a second
//!   later: a scrape that takes a second);
//! - a request's headers must arrive within `timeout` of the connection
//!   opening or of the previous response (a client that connects and sends
//!   nothing, or dribbles, is dropped then); headers larger than 16 KiB are
//!   refused; a connection lives at most `MAX_AGE_TIMEOUTS` timeouts, then
//!   closes after its current response, or at once if that takes one more;
//! - scrapes (file reads) run on at most two threads at once, the rest
//!   queue: memory stays flat however many clients scrape together.

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::TcpListener;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
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
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{oneshot, Notify};

/// The largest request head read (hyper's buffer), and so the most a peek
/// into a socket looks at.
const MAX_HEAD: usize = 16 << 10;

/// How many timeouts a connection may live.
const MAX_AGE_TIMEOUTS: u32 = 6;

/// The listen queue asked for (the kernel caps it at net.core.somaxconn,
/// 4096 by default): connects that arrive while the accept loop is busy
/// wait there; with std's 128, a burst overflows it and the kernel drops
/// the SYNs past it, which the client sends again a second later (a scrape
/// that takes a second).
const LISTEN_BACKLOG: i32 = 4096;

/// A socket listening on `addr` with a `LISTEN_BACKLOG` queue.
pub fn listen(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    // As std's bind does: a port in TIME_WAIT from a previous run can be reused.
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(socket.into())
}

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
    /// Its socket, to look for a request waiting in it.
    socket: Arc<Socket>,
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
    /// Every open connection has a request in progress or waiting.
    Busy,
    /// At the bound, the newcomer sent part of a request and no more yet,
    /// or closed: it gets no room (a flood of such connects costs an
    /// accept and a close each, and closes no one else).
    Shed,
}

impl Connections {
    /// Room for one more connection under `max`, for a newcomer in whose
    /// socket `arrived` waits. A connection closed to make room counts
    /// until its socket is closed (so open files never pass the bound): the
    /// oldest idle one is told to close, and the caller waits for it.
    fn make_room(&mut self, max: usize, arrived: Waiting) -> Room {
        if self.open.len() < max {
            return Room::Free;
        }
        if matches!(arrived, Waiting::Partial | Waiting::Closed) {
            return Room::Shed;
        }
        if self.open.values().any(|c| c.close.is_none()) {
            return Room::Closing;
        }
        let idle = |c: &&mut Open| c.busy == 0 && Waiting::in_socket(&c.socket) != Waiting::Request;
        let Some(oldest_idle) = self.open.values_mut().find(idle) else {
            return Room::Busy;
        };
        if let Some(close) = oldest_idle.close.take() {
            let _ = close.send(());
        }
        Room::Closing
    }

    fn add(&mut self, socket: Arc<Socket>, close: oneshot::Sender<()>) -> u64 {
        self.next += 1;
        self.open.insert(self.next, Open { busy: 0, socket, close: Some(close) });
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

/// A connection's socket, shared by its task (hyper reads and writes it
/// through `SocketIo`) and the accept loop (which looks into it before
/// closing the connection to make room).
struct Socket {
    stream: tokio::net::TcpStream,
    /// The last four bytes hyper read, the newest in the low byte: a
    /// request's head may end in them and the bytes still unread.
    last_read: AtomicU32,
}

impl Socket {
    fn new(stream: tokio::net::TcpStream) -> Arc<Socket> {
        Arc::new(Socket { stream, last_read: AtomicU32::new(0) })
    }

    fn remember(&self, read: &[u8]) {
        if let Some(&[a, b, c, d]) = read.last_chunk::<4>() {
            self.last_read.store(u32::from_be_bytes([a, b, c, d]), Ordering::Relaxed);
        } else {
            let mut last = self.last_read.load(Ordering::Relaxed);
            for &byte in read {
                last = last << 8 | byte as u32;
            }
            self.last_read.store(last, Ordering::Relaxed);
        }
    }
}

/// What waits unread in a socket, as a peek sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Waiting {
    /// No byte yet (a client that has not written, or between requests).
    Nothing,
    /// Part of a request's head: no empty line yet.
    Partial,
    /// A request's head, whole (its empty line arrived): a request to serve.
    Request,
    /// The client closed its end with nothing left to read, or the socket broke.
    Closed,
}

impl Waiting {
    /// What waits in `stream` (non-blocking), after `last_read` (the last
    /// four bytes read from it, the newest in the low byte); `waiting` is
    /// the peek's buffer (`MAX_HEAD` bytes: a longer head is refused anyway).
    fn in_stream(stream: &std::net::TcpStream, last_read: u32, waiting: &mut [u8]) -> Waiting {
        match stream.peek(waiting) {
            Err(e) if e.kind() == ErrorKind::WouldBlock => Waiting::Nothing,
            Err(_) | Ok(0) => Waiting::Closed,
            Ok(n) => {
                // The head's end in the bytes waiting, or across the last read ones.
                let before = last_read.to_be_bytes();
                let joined = before[1..].iter().chain(&waiting[..n.min(3)]).copied().collect::<Vec<u8>>();
                if waiting[..n].windows(4).chain(joined.windows(4)).any(|w| w == b"\r\n\r\n") {
                    Waiting::Request
                } else {
                    Waiting::Partial
                }
            }
        }
    }

    /// What waits in a served connection's socket (a duplicate of it is
    /// peeked into: the bytes stay for hyper).
    fn in_socket(socket: &Socket) -> Waiting {
        match socket2::SockRef::from(&socket.stream).try_clone() {
            Ok(peer) => Waiting::in_stream(&peer.into(), socket.last_read.load(Ordering::Relaxed), &mut vec![0u8; MAX_HEAD]),
            Err(_) => Waiting::Closed,
        }
    }
}

/// hyper's reads and writes of a shared `Socket`.
struct SocketIo(Arc<Socket>);

impl AsyncRead for SocketIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let socket = &self.0;
        loop {
            ready!(socket.stream.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match socket.stream.try_read(unfilled) {
                Ok(n) => {
                    socket.remember(&unfilled[..n]);
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                // Readiness was cleared: wait for it again.
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for SocketIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        loop {
            ready!(self.0.stream.poll_write_ready(cx))?;
            match self.0.stream.try_write(data) {
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                other => return Poll::Ready(other),
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(socket2::SockRef::from(&self.0.stream).shutdown(std::net::Shutdown::Write))
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
/// Connections are accepted on the calling thread, served on a runtime of
/// two threads: the kernel's queue is drained however busy they are.
pub fn serve(exporter: Arc<Exporter>, listener: TcpListener, options: ServeOptions) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(2)
        .thread_name("tidepool-exporter")
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the server's runtime: {e}"))?;
    let connections: Arc<Shared> = Arc::default();
    let max = options.max_connections.max(1);
    // The peeks' buffer, used again for every newcomer.
    let mut peek = vec![0u8; MAX_HEAD];
    for incoming in listener.incoming() {
        let stream = match incoming {
            Ok(stream) => stream,
            Err(err) => {
                // Out of file descriptors, say: wait rather than spin.
                eprintln!("tidepool exporter: accept: {err}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if stream.set_nonblocking(true).is_err() {
            continue;
        }
        let arrived = Waiting::in_stream(&stream, 0, &mut peek);
        // Shed at once, before anything is made for it (see `Room::Shed`).
        if connections.lock().make_room(max, arrived) == Room::Shed {
            continue;
        }
        let (close, closed) = oneshot::channel();
        let socket = {
            let _runtime = runtime.enter();
            match tokio::net::TcpStream::from_std(stream) {
                Ok(stream) => Socket::new(stream),
                Err(_) => continue,
            }
        };
        let id = loop {
            let mut one_closed = std::pin::pin!(connections.one_closed.notified());
            one_closed.as_mut().enable();
            {
                let mut open = connections.lock();
                match open.make_room(max, arrived) {
                    Room::Free => break Some(open.add(socket.clone(), close)),
                    Room::Busy | Room::Shed => break None,
                    Room::Closing => {}
                }
            }
            runtime.block_on(one_closed);
        };
        // None: the newcomer is closed at once (see `make_room`).
        if let Some(id) = id {
            let (exporter, connections, timeout) = (exporter.clone(), connections.clone(), options.timeout);
            runtime.spawn(serve_connection(socket, exporter, Registered(connections, id), closed, timeout));
        }
    }
    Ok(())
}

/// Serves one connection until it ends, is closed to make room (`closed`)
/// or has lived `MAX_AGE_TIMEOUTS` timeouts.
async fn serve_connection(
    socket: Arc<Socket>,
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
    builder.timer(TokioTimer::new()).header_read_timeout(timeout).max_buf_size(MAX_HEAD);
    {
        let mut connection = std::pin::pin!(builder.serve_connection(TokioIo::new(SocketIo(socket)), service));
        tokio::select! {
            _ = closed => {}
            lived = tokio::time::timeout(timeout * MAX_AGE_TIMEOUTS, connection.as_mut()) => {
                if lived.is_err() {
                    connection.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(timeout, connection).await;
                }
            }
        }
    } // hyper's handle on the socket goes here; the last one goes with the
      // connection's entry: the socket is closed before the accept loop hears
      // that it stopped counting
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
    use std::io::Write;

    /// `count` connected pairs on loopback: the server's sockets (in a
    /// runtime, as the server has them) and the clients' ends.
    fn pairs(count: usize) -> (tokio::runtime::Runtime, Vec<Arc<Socket>>, Vec<std::net::TcpStream>) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let clients: Vec<_> = (0..count).map(|_| std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap()).collect();
        let sockets = (0..count)
            .map(|_| {
                let (stream, _) = listener.accept().unwrap();
                stream.set_nonblocking(true).unwrap();
                let _guard = runtime.enter();
                Socket::new(tokio::net::TcpStream::from_std(stream).unwrap())
            })
            .collect();
        (runtime, sockets, clients)
    }

    fn with_open(count: usize) -> (Connections, Vec<oneshot::Receiver<()>>, tokio::runtime::Runtime, Vec<std::net::TcpStream>) {
        let (runtime, sockets, clients) = pairs(count);
        let mut open = Connections::default();
        let receivers = sockets
            .into_iter()
            .map(|socket| {
                let (close, closed) = oneshot::channel();
                open.add(socket, close);
                closed
            })
            .collect();
        (open, receivers, runtime, clients)
    }

    /// Waits until `socket` holds `n` unread bytes (loopback delivers at once, but not synchronously).
    fn arrived(socket: &Socket, n: usize) {
        let peer: std::net::TcpStream = socket2::SockRef::from(&socket.stream).try_clone().unwrap().into();
        let mut buf = vec![0u8; n];
        for _ in 0..1000 {
            if peer.peek(&mut buf).is_ok_and(|got| got >= n) {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("{n} bytes never arrived");
    }

    #[test]
    fn a_request_waiting_in_the_socket_is_seen_and_a_partial_one_is_not() {
        let (_runtime, sockets, mut clients) = pairs(3);
        assert_eq!(Waiting::in_socket(&sockets[0]), Waiting::Nothing);
        let part: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: x\r\n";
        clients[0].write_all(part).unwrap();
        arrived(&sockets[0], part.len());
        assert_eq!(Waiting::in_socket(&sockets[0]), Waiting::Partial);
        clients[0].write_all(b"\r\n").unwrap();
        arrived(&sockets[0], part.len() + 2);
        assert_eq!(Waiting::in_socket(&sockets[0]), Waiting::Request);
        // The head's end split between what hyper read and what waits.
        sockets[1].remember(b"GET / HTTP/1.1\r\nHost: x\r\n\r");
        clients[1].write_all(b"\n").unwrap();
        arrived(&sockets[1], 1);
        assert_eq!(Waiting::in_socket(&sockets[1]), Waiting::Request);
        // A client that sent part of a head and closed: nothing to serve.
        clients[2].write_all(part).unwrap();
        clients[2].shutdown(std::net::Shutdown::Both).unwrap();
        arrived(&sockets[2], part.len());
        assert_eq!(Waiting::in_socket(&sockets[2]), Waiting::Partial);
        let mut rest = vec![0u8; part.len()];
        let peer: std::net::TcpStream = socket2::SockRef::from(&sockets[2].stream).try_clone().unwrap().into();
        std::io::Read::read_exact(&mut &peer, &mut rest).unwrap();
        assert_eq!(Waiting::in_socket(&sockets[2]), Waiting::Closed, "all read, then the client's end");
    }

    #[test]
    fn a_connection_with_a_request_waiting_is_not_closed_to_make_room() {
        let (mut open, mut closed, _runtime, mut clients) = with_open(2);
        let request: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
        clients[0].write_all(request).unwrap();
        arrived(&open.open[&1].socket, request.len());
        assert_eq!(open.make_room(2, Waiting::Nothing), Room::Closing);
        assert!(closed[0].try_recv().is_err(), "its request waits: not idle");
        assert_eq!(closed[1].try_recv(), Ok(()));
        open.open.remove(&2);
        clients[1].write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let (_, sockets, _more) = pairs(1);
        let (close, _closed) = oneshot::channel();
        open.add(sockets[0].clone(), close);
        open.busy(3, 1);
        assert_eq!(open.make_room(2, Waiting::Request), Room::Busy, "one waits, one is busy: the newcomer is refused");
    }

    #[test]
    fn at_the_bound_a_newcomer_with_part_of_a_request_or_closed_is_shed_and_closes_no_one() {
        let (mut open, mut closed, _runtime, _clients) = with_open(2);
        assert_eq!(open.make_room(3, Waiting::Partial), Room::Free, "below the bound, anyone is served");
        for newcomer in [Waiting::Partial, Waiting::Closed] {
            assert_eq!(open.make_room(2, newcomer), Room::Shed);
        }
        assert!(closed.iter_mut().all(|c| c.try_recv().is_err()), "no one was closed for them");
        assert_eq!(open.make_room(2, Waiting::Request), Room::Closing);
        assert_eq!(closed[0].try_recv(), Ok(()), "a request makes room");
    }

    #[test]
    fn a_connection_closed_to_make_room_counts_until_its_task_forgets_it() {
        let (mut open, mut closed, _runtime, _clients) = with_open(3);
        assert_eq!(open.make_room(4, Waiting::Nothing), Room::Free);
        open.busy(1, 1);
        // At the bound: the oldest idle one (2, as 1 is busy) is told to close.
        assert_eq!(open.make_room(3, Waiting::Nothing), Room::Closing);
        assert!(closed[0].try_recv().is_err(), "a busy connection is not closed");
        assert_eq!(closed[1].try_recv(), Ok(()));
        assert!(closed[2].try_recv().is_err());
        // Until its task has closed the socket it still counts, and no other is closed.
        assert_eq!(open.open.len(), 3);
        assert_eq!(open.make_room(3, Waiting::Request), Room::Closing);
        assert!(closed[2].try_recv().is_err(), "one closing is enough");
        open.open.remove(&2);
        assert_eq!(open.make_room(3, Waiting::Request), Room::Free);
    }

    #[test]
    fn the_newcomer_is_refused_only_while_every_connection_is_busy() {
        let (mut open, _closed, _runtime, _clients) = with_open(2);
        open.busy(1, 1);
        open.busy(2, 1);
        assert_eq!(open.make_room(2, Waiting::Request), Room::Busy);
        open.busy(2, -1);
        assert_eq!(open.make_room(2, Waiting::Request), Room::Closing);
    }
}
