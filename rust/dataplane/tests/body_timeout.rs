//! The body read timeout: a client that sends its head and part of its body,
//! then stalls, is answered 408 (protocol-shaped, `connection: close`) and
//! leaves nothing recorded or in the tables.  Raw TCP, so the test controls
//! exactly what is sent.  No wall-clock assertion: the timeout is short so
//! the test is quick, and the reads' own timeouts only guard against a hang.
#![cfg(not(loom))]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use lowwater_dataplane::{Config, ConfigError, DataPlane, StartError, Stats};

#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOC: lowwater_dataplane::Allocator = lowwater_dataplane::Allocator;

/// A guard against a hang, not a timing assertion.
const GUARD: Duration = Duration::from_secs(20);

fn plane(body_read_timeout: Duration) -> Result<DataPlane, StartError> {
    // Nothing listens on port 9: no call of these tests gets as far as forwarding.
    let mut config = Config::new("http://127.0.0.1:9/v1");
    config.body_read_timeout = body_read_timeout;
    config.retries = 0;
    DataPlane::start(config, "127.0.0.1:0".parse().unwrap())
}

/// Send `head` and `partial` of a body, stall, and read whatever comes back
/// until the server closes the connection.
fn stalled_call(addr: SocketAddr, head: &str, partial: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(GUARD)).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(partial).unwrap();
    let mut got = Vec::new();
    s.read_to_end(&mut got).expect("the server answers and closes the connection");
    String::from_utf8(got).unwrap()
}

fn status_and_body(answer: &str) -> (u16, serde_json::Value) {
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no full answer: {answer:?}"));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap();
    assert!(head.to_ascii_lowercase().contains("connection: close"), "{head}");
    (status, serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body:?}")))
}

fn settled(plane: &DataPlane) -> Stats {
    for _ in 0..4000 {
        let s = plane.stats();
        if s.active_calls == 0 {
            return s;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("calls never ended: {:?}", plane.stats());
}

#[test]
fn a_stalled_body_is_408_and_leaves_nothing() {
    let plane = plane(Duration::from_millis(200)).unwrap();
    plane.register("r", "s").unwrap();
    let addr = plane.local_addr();
    let partial = br#"{"model":"m","messages":[{"role":"us"#;

    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer s\r\n\
                content-type: application/json\r\ncontent-length: 200\r\n\r\n";
    let (status, body) = status_and_body(&stalled_call(addr, head, partial));
    assert_eq!(status, 408);
    assert_eq!(body["error"]["code"], 408, "the OpenAI shape: {body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("not received"), "{body}");

    // Chunked, and in the Anthropic shape.
    let head = "POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: s\r\ntransfer-encoding: chunked\r\n\r\n";
    let chunk = [format!("{:x}\r\n", partial.len()).as_bytes(), partial, b"\r\n"].concat();
    let (status, body) = status_and_body(&stalled_call(addr, head, &chunk));
    assert_eq!(status, 408);
    assert_eq!((body["type"].as_str(), body["error"]["type"].as_str()), (Some("error"), Some("api_error")));

    // The head alone, no body byte at all.
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-api-key: s\r\ncontent-length: 10\r\n\r\n";
    assert_eq!(status_and_body(&stalled_call(addr, head, b"")).0, 408);

    // A body over the table's mmap threshold (1 MiB) is read straight into a
    // payload of the table's: stalled, its memory goes with the call.
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-api-key: s\r\ncontent-length: 2097152\r\n\r\n";
    assert_eq!(status_and_body(&stalled_call(addr, head, partial)).0, 408);
    assert_eq!(plane.table().stats().live_bytes, 0, "the stalled body's payload is freed");

    let s = settled(&plane);
    assert_eq!((s.calls, s.refused, s.ok, s.failed), (4, 4, 0, 0), "{s:?}");
    assert_eq!((s.in_flight, s.queued, s.awaiting_ack), (0, 0, 0), "nothing recorded or left in flight: {s:?}");
    assert!(plane.queue().drain().is_empty());
    assert_eq!(plane.unregister("r"), Some(0), "no call of the rollout left to cancel");
}

#[test]
fn a_zero_body_read_timeout_is_refused() {
    let err = plane(Duration::ZERO).unwrap_err();
    assert!(matches!(err, StartError::Config(ConfigError::Limit("body_read_timeout"))), "{err}");
}

#[test]
fn a_large_body_cut_short_is_400_and_leaves_nothing() {
    let plane = plane(Duration::from_secs(30)).unwrap();
    plane.register("r", "s").unwrap();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-api-key: s\r\ncontent-length: 2097152\r\n\r\n";
    let mut s = TcpStream::connect(plane.local_addr()).unwrap();
    s.set_read_timeout(Some(GUARD)).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(&vec![b' '; 1 << 20]).unwrap();
    // Half the declared body, then the client's end of the stream.
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut got = Vec::new();
    s.read_to_end(&mut got).expect("the server answers and closes the connection");
    let (status, body) = status_and_body(&String::from_utf8(got).unwrap());
    assert_eq!(status, 400);
    assert!(body["error"]["message"].as_str().unwrap().contains("cut short"), "{body}");
    let st = settled(&plane);
    assert_eq!((st.refused, st.in_flight, st.intercepts), (1, 0, 0), "{st:?}");
    assert_eq!(plane.table().stats().live_bytes, 0, "the cut body's payload is freed");
}
