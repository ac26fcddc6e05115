//! The upstream client: one pooled hyper client per data plane, retries with
//! full-jitter backoff (honouring `Retry-After`), a concurrency bound, and
//! the upstream's key in place of the rollout's secret.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ConfigError;
use crate::plane::Config;

#[cfg(feature = "tls")]
type Connector = hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>;
#[cfg(not(feature = "tls"))]
type Connector = hyper_util::client::legacy::connect::HttpConnector;

/// Statuses retried before the answer reaches the agent (the Python client's).
const RETRY_STATUSES: [u16; 5] = [429, 500, 502, 503, 504];

/// Why an upstream call produced no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum UpstreamError {
    /// Unreachable, refused, reset, or an answer cut or too large: 502,
    /// with the whole reason (`upstream unreachable: ...`).
    Failed(String),
    /// No answer within the timeout: 504.
    Timeout,
}

impl UpstreamError {
    pub(crate) fn status(&self) -> u16 {
        match self {
            UpstreamError::Failed(_) => 502,
            UpstreamError::Timeout => 504,
        }
    }

    pub(crate) fn reason(&self) -> String {
        match self {
            UpstreamError::Failed(why) => why.clone(),
            UpstreamError::Timeout => "upstream timed out".into(),
        }
    }
}

/// An upstream answer's head, with its concurrency permit (held while the
/// body is read).
pub(crate) struct Answer {
    pub(crate) response: Response<Incoming>,
    pub(crate) _permit: OwnedSemaphorePermit,
}

pub(crate) struct Upstream {
    client: Client<Connector, Full<Bytes>>,
    default: Target,
    default_url: String,
    default_key: Option<String>,
    limiter: Arc<Semaphore>,
    retries: u32,
    backoff: Duration,
    max_backoff: Duration,
    pub(crate) timeout: Duration,
    jitter: foldhash::fast::RandomState,
    counter: std::sync::atomic::AtomicU64,
    /// Attempts sent, and of those the retries (since start).
    pub(crate) requests: std::sync::atomic::AtomicU64,
    pub(crate) retried: std::sync::atomic::AtomicU64,
}

/// Where a call goes: a base URL and the headers carrying its key.  The
/// plane's own, or a rollout's (`register` with an upstream or key); the
/// client pools connections per origin, so any number share it.
#[derive(Debug)]
pub(crate) struct Target {
    base: String,
    headers: HeaderMap,
}

/// `url` checked as an upstream base URL: http, or https with the `tls` feature.
fn check_url(url: &str) -> Result<(), ConfigError> {
    let uri: http::Uri = url.parse().map_err(|e| ConfigError::Upstream(format!("{e}")))?;
    if uri.authority().is_none() {
        return Err(ConfigError::Upstream("no host".into()));
    }
    match uri.scheme_str() {
        Some("http") => Ok(()),
        Some("https") if cfg!(feature = "tls") => Ok(()),
        Some("https") => Err(ConfigError::HttpsNeedsTls),
        _ => Err(ConfigError::Upstream("the scheme must be http or https".into())),
    }
}

/// `url` without its `user:password@`, and the `Authorization: Basic`
/// value of those credentials (percent-decoded, as a browser sends them).
fn split_userinfo(url: &str) -> Result<(String, Option<HeaderValue>), ConfigError> {
    let Some((scheme, rest)) = url.split_once("://") else { return Ok((url.to_owned(), None)) };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else { return Ok((url.to_owned(), None)) };
    let userinfo = percent_decode(&rest[..at]);
    let encoded = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, userinfo);
    let value = HeaderValue::from_str(&format!("Basic {encoded}"))
        .map_err(|_| ConfigError::Upstream("the upstream URL's credentials cannot be sent".into()))?;
    Ok((format!("{scheme}://{}", &rest[at + 1..]), Some(value)))
}

/// `%XX` escapes decoded to bytes (anything else kept as is).
fn percent_decode(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    out
}

impl Target {
    fn new(url: &str, key: Option<&str>) -> Result<Self, ConfigError> {
        // A gateway behind HTTP basic auth: the credentials leave the URL (so
        // they are never in a log line or an error) for an `Authorization:
        // Basic` header, as the Python client sends them (RFC 7617).
        let (url, basic) = split_userinfo(url)?;
        let url = url.as_str();
        check_url(url)?;
        let mut headers = HeaderMap::new();
        headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        // Relayed bytes are recorded as they are: ask for no content-encoding.
        headers.insert(http::header::ACCEPT_ENCODING, HeaderValue::from_static("identity"));
        if let Some(key) = key {
            let bearer = HeaderValue::from_str(&format!("Bearer {key}"))
                .map_err(|_| ConfigError::Upstream("the upstream key must be visible ASCII".into()))?;
            let plain = HeaderValue::from_str(key)
                .map_err(|_| ConfigError::Upstream("the upstream key must be visible ASCII".into()))?;
            headers.insert(http::header::AUTHORIZATION, bearer);
            headers.insert("x-api-key", plain);
        }
        if let Some(basic) = basic {
            headers.insert(http::header::AUTHORIZATION, basic);
        }
        Ok(Target { base: url.trim_end_matches('/').to_string(), headers })
    }

    /// The upstream URL of an interception path (`/v1/chat/completions` ->
    /// `{base}/chat/completions`, as the Python client joins them).
    fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path.strip_prefix("/v1").unwrap_or(path))
    }
}

impl Upstream {
    pub(crate) fn new(config: &Config) -> Result<Self, ConfigError> {
        let default = Target::new(&config.upstream, config.upstream_key.as_deref())?;
        if config.max_concurrency == 0 {
            return Err(ConfigError::Limit("max_concurrency"));
        }
        let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
        http.set_connect_timeout(Some(config.upstream_timeout));
        http.set_nodelay(true);
        #[cfg(feature = "tls")]
        let http = {
            http.enforce_http(false);
            hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(tls_config()?)
                .https_or_http()
                .enable_http1()
                .wrap_connector(http)
        };
        let client = Client::builder(TokioExecutor::new())
            // Idle connections are closed after this (the Python client's
            // keep-alive expiry): a burst's connections do not stay for good.
            .pool_idle_timeout(config.pool_idle_timeout)
            .pool_timer(TokioTimer::new())
            .build(http);
        Ok(Upstream {
            client,
            default,
            default_url: config.upstream.clone(),
            default_key: config.upstream_key.clone(),
            limiter: Arc::new(Semaphore::new(config.max_concurrency)),
            retries: config.retries,
            backoff: config.backoff,
            max_backoff: config.max_backoff,
            timeout: config.upstream_timeout,
            jitter: foldhash::fast::RandomState::default(),
            counter: std::sync::atomic::AtomicU64::new(0),
            requests: std::sync::atomic::AtomicU64::new(0),
            retried: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// A rollout's target: `url` (default: the plane's upstream) with `key`
    /// (default: the plane's key); `None` when both are the plane's.
    ///
    /// # Errors
    /// As at start: a bad URL, https without `tls`, a key that is not visible ASCII.
    pub(crate) fn target(&self, url: Option<&str>, key: Option<&str>) -> Result<Option<Arc<Target>>, ConfigError> {
        if url.is_none() && key.is_none() {
            return Ok(None);
        }
        let url = url.unwrap_or(&self.default_url);
        let key = key.or(self.default_key.as_deref());
        Target::new(url, key).map(|t| Some(Arc::new(t)))
    }

    /// POST `body` to `path` of `target` (`None`: the plane's upstream) with
    /// `extra` headers; errors before the answer's head, 429 and 5xx are retried up to
    /// `retries` times; the last attempt's answer is returned whatever its
    /// status.  Dropping the future aborts the call.
    pub(crate) async fn post(
        &self,
        target: Option<&Target>,
        path: &str,
        body: Bytes,
        extra: &HeaderMap,
    ) -> Result<Answer, UpstreamError> {
        let target = target.unwrap_or(&self.default);
        let url = target.url(path);
        let mut attempt = 0u32;
        loop {
            let permit = Arc::clone(&self.limiter).acquire_owned().await.expect("the limiter is never closed");
            let mut req = Request::builder()
                .method(Method::POST)
                .uri(&url)
                .body(Full::new(body.clone()))
                .map_err(|e| UpstreamError::Failed(format!("upstream request invalid: {e}")))?;
            self.requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if attempt > 0 {
                self.retried.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            let headers = req.headers_mut();
            headers.extend(target.headers.iter().map(|(k, v)| (k.clone(), v.clone())));
            headers.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
            let delay = match tokio::time::timeout(self.timeout, self.client.request(req)).await {
                Err(_) => return Err(UpstreamError::Timeout),
                Ok(Err(e)) if retriable(&e) && attempt < self.retries => self.backoff_delay(attempt),
                Ok(Err(e)) => return Err(UpstreamError::Failed(format!("upstream unreachable: {}", error_chain(&e)))),
                Ok(Ok(resp)) if RETRY_STATUSES.contains(&resp.status().as_u16()) && attempt < self.retries => {
                    retry_after(resp.status(), resp.headers(), self.max_backoff)
                        .unwrap_or_else(|| self.backoff_delay(attempt))
                }
                Ok(Ok(response)) => return Ok(Answer { response, _permit: permit }),
            };
            // The permit is released during the backoff (the answer, if any, is dropped).
            drop(permit);
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    /// Full jitter: uniform in `[0, min(max_backoff, backoff * 2^attempt)]`.
    fn backoff_delay(&self, attempt: u32) -> Duration {
        use std::hash::BuildHasher;
        let cap = self.backoff.saturating_mul(1u32 << attempt.min(20)).min(self.max_backoff);
        let n = self.counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let unit = (self.jitter.hash_one(n) >> 11) as f64 / (1u64 << 53) as f64;
        cap.mul_f64(unit)
    }
}

/// The delay a 429/503's `Retry-After` (delta-seconds) asks for, capped.
fn retry_after(status: StatusCode, headers: &HeaderMap, cap: Duration) -> Option<Duration> {
    if status != StatusCode::TOO_MANY_REQUESTS && status != StatusCode::SERVICE_UNAVAILABLE {
        return None;
    }
    let secs: f64 = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?.trim().parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs).min(cap))
}

/// The TLS client of `https://` upstreams: the Mozilla roots (webpki-roots),
/// and the certificates of the PEM file `SSL_CERT_FILE` names, if set (as
/// OpenSSL, httpx and the `openai` SDK honour it: a private CA, or a test's
/// own).  A file that cannot be read or holds no certificate is a
/// `ConfigError::Tls` at start, not a later handshake failure.
#[cfg(feature = "tls")]
fn tls_config() -> Result<rustls::ClientConfig, ConfigError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
    if let Some(path) = std::env::var_os("SSL_CERT_FILE").filter(|p| !p.is_empty()) {
        let shown = std::path::Path::new(&path).display().to_string();
        let bad = |why: String| ConfigError::Tls(format!("SSL_CERT_FILE {shown}: {why}"));
        let certs = CertificateDer::pem_file_iter(&path)
            .map_err(|e| bad(e.to_string()))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(e.to_string()))?;
        if certs.is_empty() {
            return Err(bad("no certificate in it".into()));
        }
        for cert in certs {
            roots.add(cert).map_err(|e| bad(e.to_string()))?;
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ConfigError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// Whether a failed request may be sent again: every error before the
/// answer's head (connect, reset, closed or malformed before a response
/// existed), as the Python client retried `ConnectError`, `ReadError`,
/// `WriteError` and `RemoteProtocolError`: the agent has seen nothing, so a
/// retry cannot duplicate output.  Not a request hyper refused to send (a
/// user error: the same request would be refused again).  A timeout never
/// reaches here (retrying it would multiply the wait on a stuck upstream).
fn retriable(e: &hyper_util::client::legacy::Error) -> bool {
    if e.is_connect() {
        return true;
    }
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            return !h.is_user();
        }
        src = s.source();
    }
    true
}

/// An error and its sources, one line (hyper's top-level message alone is
/// "client error (Connect)").
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_the_url_become_a_basic_header() {
        let (url, basic) = split_userinfo("http://us%40er:p%3Ass@host:8/v1").unwrap();
        assert_eq!(url, "http://host:8/v1");
        // base64("us@er:p:ss")
        assert_eq!(basic.unwrap(), "Basic dXNAZXI6cDpzcw==");
        let (url, basic) = split_userinfo("http://host:8/v1/a@b").unwrap();
        assert_eq!((url.as_str(), basic), ("http://host:8/v1/a@b", None));
        let t = Target::new("http://u:p@host:8/v1", Some("k")).unwrap();
        assert_eq!(t.base, "http://host:8/v1");
        assert_eq!(t.headers[http::header::AUTHORIZATION], "Basic dTpw");
        assert_eq!(t.headers["x-api-key"], "k");
    }

    #[test]
    fn retry_after_is_capped_and_only_for_429_503() {
        let mut h = HeaderMap::new();
        h.insert(http::header::RETRY_AFTER, HeaderValue::from_static("30"));
        let cap = Duration::from_secs(8);
        assert_eq!(retry_after(StatusCode::TOO_MANY_REQUESTS, &h, cap), Some(cap));
        assert_eq!(retry_after(StatusCode::BAD_GATEWAY, &h, cap), None);
        h.insert(http::header::RETRY_AFTER, HeaderValue::from_static("0.5"));
        assert_eq!(retry_after(StatusCode::SERVICE_UNAVAILABLE, &h, cap), Some(Duration::from_millis(500)));
        h.insert(http::header::RETRY_AFTER, HeaderValue::from_static("soon"));
        assert_eq!(retry_after(StatusCode::TOO_MANY_REQUESTS, &h, cap), None);
    }
}
