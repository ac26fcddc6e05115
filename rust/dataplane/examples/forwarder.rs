//! The floor of any proxy hop: a minimal HTTP/1.1 forwarder on the data
//! plane's own stack (hyper's server, hyper-util's pooled client, tokio with
//! the plane's worker count, `TCP_NODELAY` both ways), doing nothing but
//! reading a request body, POSTing it to the same path upstream and
//! returning the answer's status, content type and body.  No secret, no
//! table, no parse, no record: what the added latency of an extra loopback
//! hop is on this host, measured beside the plane in the same run
//! (`benches/interception.py --forwarder`).
//!
//! `cargo run --profile dist -p lowwater-dataplane --no-default-features --example forwarder -- http://127.0.0.1:8000 [workers]`
//! prints `http://127.0.0.1:PORT` on its first stdout line and serves until
//! killed.  An upstream failure answers 502 (never a panic).
// Under `--cfg loom` the crate has no server (tokio is not built): nothing to run.
#![cfg_attr(loom, allow(dead_code, unused_imports))]

#[cfg(loom)]
fn main() {}

#[cfg(not(loom))]
fn main() {
    use std::io::Write;

    let mut args = std::env::args().skip(1);
    let Some(upstream) = args.next() else {
        eprintln!("usage: forwarder UPSTREAM_ORIGIN [WORKER_THREADS]");
        std::process::exit(2);
    };
    let workers = match args.next().map(|w| w.parse::<usize>()) {
        None => lowwater_dataplane::default_worker_threads(), // the plane's default
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("WORKER_THREADS must be a positive integer");
            std::process::exit(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a loopback port");
        let mut out = std::io::stdout();
        let _ = writeln!(out, "http://{}", listener.local_addr().expect("a bound address"));
        let _ = out.flush();
        serve(listener, upstream.trim_end_matches('/').to_owned()).await;
    });
}

/// The pooled upstream client, as the plane's (`src/upstream.rs`) without TLS.
#[cfg(not(loom))]
type UpstreamClient = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<bytes::Bytes>,
>;

#[cfg(not(loom))]
async fn serve(listener: tokio::net::TcpListener, upstream: String) {
    use std::sync::Arc;

    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::{TokioExecutor, TokioIo};

    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: UpstreamClient = hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(connector);
    let shared = Arc::new((client, upstream));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            // Out of fds, or a connection reset before accept: do not spin on it.
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let shared = Arc::clone(&shared);
                async move { Ok::<_, std::convert::Infallible>(forward(&shared.0, &shared.1, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}

/// One call: the body read whole, POSTed upstream, the answer read whole.
#[cfg(not(loom))]
async fn forward(
    client: &UpstreamClient,
    upstream: &str,
    req: hyper::Request<hyper::body::Incoming>,
) -> hyper::Response<http_body_util::Full<bytes::Bytes>> {
    use http::header::CONTENT_TYPE;
    use http_body_util::{BodyExt, Full};

    let failed = |why: String| {
        let mut r = hyper::Response::new(Full::new(bytes::Bytes::from(why)));
        *r.status_mut() = http::StatusCode::BAD_GATEWAY;
        r
    };
    let url = format!("{upstream}{}", req.uri().path());
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return failed(format!("request body: {e}")),
    };
    let request = match hyper::Request::post(url).header(CONTENT_TYPE, "application/json").body(Full::new(body)) {
        Ok(r) => r,
        Err(e) => return failed(format!("request: {e}")),
    };
    let answer = match client.request(request).await {
        Ok(a) => a,
        Err(e) => return failed(format!("upstream: {e}")),
    };
    let (head, body) = answer.into_parts();
    let bytes = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return failed(format!("upstream answer: {e}")),
    };
    let mut r = hyper::Response::new(Full::new(bytes));
    *r.status_mut() = head.status;
    if let Some(ct) = head.headers.get(CONTENT_TYPE) {
        r.headers_mut().insert(CONTENT_TYPE, ct.clone());
    }
    r
}
