//! `tidepool exporter`'s HTTP server: `GET /metrics` (the scrape, in the
//! format the `Accept` header prefers) and `GET /` (a page linking to it);
//! 404 for other paths, 405 for other methods (HEAD is GET without a body).
//!
//! Bounds, so a scraper or a stray client cannot exhaust the host: at most
//! `max_connections` connections at once (the rest wait in the kernel's
//! backlog until one closes), a request's headers must arrive within
//! `timeout` of the connection opening or of the previous response (a
//! client that connects and sends nothing is dropped then), headers larger
//! than 16 KiB are refused, and a connection lives at most
//! `MAX_AGE_TIMEOUTS` timeouts: then it closes after its current response,
//! or at once if that takes one more timeout. Scrapes (file reads) run on
//! at most two threads at once, the rest queue: memory stays flat however
//! many clients scrape together.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use super::exposition::Format;
use super::Exporter;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ACCEPT, ALLOW, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};

/// How many timeouts a connection may live.
const MAX_AGE_TIMEOUTS: u32 = 6;

pub struct ServeOptions {
    pub timeout: Duration,
    pub max_connections: usize,
}

const INDEX: &str = "<!DOCTYPE html>\n<html><head><title>tidepool exporter</title></head><body>\n\
<h1>tidepool exporter</h1>\n<p>The memory of every tidepool process on this host, per device: \
<a href=\"/metrics\">/metrics</a>.</p>\n</body></html>\n";

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
        let slots = Arc::new(tokio::sync::Semaphore::new(options.max_connections.max(1)));
        loop {
            let permit = slots.clone().acquire_owned().await.expect("the semaphore is never closed");
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(err) => {
                    // Out of file descriptors, say: wait rather than spin.
                    eprintln!("tidepool exporter: accept: {err}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let exporter = exporter.clone();
            let timeout = options.timeout;
            tokio::spawn(async move {
                let _permit = permit;
                let service = service_fn(move |request| respond(exporter.clone(), request));
                let mut builder = http1::Builder::new();
                builder.timer(TokioTimer::new()).header_read_timeout(timeout).max_buf_size(16 << 10);
                let mut connection = std::pin::pin!(builder.serve_connection(TokioIo::new(stream), service));
                if tokio::time::timeout(timeout * MAX_AGE_TIMEOUTS, connection.as_mut()).await.is_err() {
                    connection.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(timeout, connection).await;
                }
            });
        }
    })
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
