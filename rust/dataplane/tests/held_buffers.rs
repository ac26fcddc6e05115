//! The plane's connection buffers are `BufferAlloc` slots while calls are
//! held, and every slot is back in the pool once the calls end, whichever
//! way they end: answered, cancelled by `unregister` (410), or left by the
//! agent mid-call.  Counted in slots handed out (deterministic), not RSS.
#![cfg(not(loom))]

use std::alloc::System;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use lowwater_dataplane::bufalloc::pooled_slots;
use lowwater_dataplane::{BufferAlloc, Config, DataPlane};

#[global_allocator]
static ALLOC: BufferAlloc<System> = BufferAlloc::new(System);

/// A guard against a hang, not a timing assertion.
const GUARD: Duration = Duration::from_secs(30);
/// Calls held at once.
const CALLS: usize = 64;
/// Calls the plane sends upstream at once; the rest wait in its queue.
const CONCURRENCY: usize = 8;

const BODY: &str = r#"{"model":"m","messages":[{"role":"user","content":"What is 2+2?"}]}"#;
const ANSWER: &str = r#"{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"4"},"finish_reason":"stop"}]}"#;

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + GUARD;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn used() -> usize {
    pooled_slots().0
}

/// A plane whose upstream accepts connections and keeps them unanswered
/// until `answer` is called; the records are acked as they come.
struct Rig {
    plane: std::sync::Arc<DataPlane>,
    upstream: TcpListener,
    held: Vec<TcpStream>,
}

impl Rig {
    fn start() -> Rig {
        let upstream = TcpListener::bind("127.0.0.1:0").unwrap();
        upstream.set_nonblocking(true).unwrap();
        let mut config = Config::new(format!("http://{}/v1", upstream.local_addr().unwrap()));
        config.retries = 0;
        config.max_concurrency = CONCURRENCY;
        config.pool_idle_timeout = Duration::from_millis(200);
        let plane = std::sync::Arc::new(DataPlane::start(config, "127.0.0.1:0".parse().unwrap()).unwrap());
        let acker = std::sync::Arc::downgrade(&plane);
        std::thread::spawn(move || {
            while let Some(plane) = acker.upgrade() {
                for r in plane.queue().drain() {
                    plane.queue().ack(r.seq);
                }
                drop(plane);
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        Rig { plane, upstream, held: Vec::new() }
    }

    fn send(&self, rollout: &str) -> TcpStream {
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: plane\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nauthorization: Bearer lw-{rollout}\r\n\r\n",
            BODY.len()
        );
        let mut c = TcpStream::connect(self.plane.local_addr()).unwrap();
        c.set_read_timeout(Some(GUARD)).unwrap();
        c.write_all(head.as_bytes()).unwrap();
        c.write_all(BODY.as_bytes()).unwrap();
        c
    }

    /// Open `CALLS` rollouts, one held call each; the clients.
    fn hold(&mut self, tag: &str) -> Vec<TcpStream> {
        let clients: Vec<TcpStream> = (0..CALLS)
            .map(|i| {
                let r = format!("{tag}{i}");
                self.plane.register(&r, &format!("lw-{r}")).unwrap();
                self.send(&r)
            })
            .collect();
        let plane = &self.plane;
        wait_for("every call in flight", || plane.stats().in_flight == CALLS);
        let (upstream, held) = (&self.upstream, &mut self.held);
        wait_for("the upstream connections", || {
            while let Ok((c, _)) = upstream.accept() {
                held.push(c);
            }
            held.len() >= CONCURRENCY
        });
        clients
    }

    /// Answer every call the upstream holds (and those that reach it next).
    fn answer_all(&mut self, calls: usize) {
        let mut answered = 0;
        let deadline = Instant::now() + GUARD;
        let reply = format!(
            "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{ANSWER}",
            ANSWER.len()
        );
        while answered < calls {
            assert!(Instant::now() < deadline, "answered {answered} of {calls}");
            while let Ok((c, _)) = self.upstream.accept() {
                self.held.push(c);
            }
            for mut c in self.held.drain(..) {
                c.set_nonblocking(false).unwrap();
                c.set_read_timeout(Some(GUARD)).unwrap();
                let mut buf = [0u8; 4096];
                let _ = c.read(&mut buf);
                c.write_all(reply.as_bytes()).unwrap();
                answered += 1;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Wait until the plane holds no connection, call or record; then the
    /// slots handed out must be back to what they were before, give or take
    /// [`SLACK`].
    fn settle(&self, before: usize) {
        let plane = &self.plane;
        wait_for("the plane to settle", || {
            let s = plane.stats();
            s.connections == 0 && s.active_calls == 0 && s.in_flight == 0 && s.queued == 0 && s.awaiting_ack == 0
        });
        let deadline = Instant::now() + GUARD;
        while used() > before + SLACK {
            assert!(
                Instant::now() < deadline,
                "{} slots still handed out ({before} before); stats {:?}",
                used(),
                plane.stats()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Slots that may stay handed out after a round, against the 2 per call it
/// held: the pool serves every allocation of its size class (4-8 KiB), not
/// only the plane's buffers, so any structure of the process that grew into
/// it may keep one (one slot was seen now and then while the completion
/// queue kept its capacity; it no longer does).  A connection's buffers kept
/// would be 2 per call, 128 here.
const SLACK: usize = 4;

fn read_status(c: &mut TcpStream) -> String {
    let mut buf = [0u8; 4096];
    let n = c.read(&mut buf).unwrap();
    String::from_utf8_lossy(&buf[..n]).lines().next().unwrap_or_default().to_owned()
}

impl Rig {
    /// Hold `CALLS` calls of fresh rollouts and answer them all.
    fn answered(&mut self, tag: &str) {
        let mut clients = self.hold(tag);
        self.answer_all(CALLS);
        for c in &mut clients {
            assert!(read_status(c).starts_with("HTTP/1.1 200"));
        }
        for i in 0..CALLS {
            self.plane.unregister(&format!("{tag}{i}"));
        }
    }
}

#[test]
fn held_calls_keep_their_buffers_in_slots_and_give_them_all_back() {
    let mut rig = Rig::start();
    // A warm-up round of the same size: the runtime's own structures (tokio's
    // I/O registration slab grows a page of this size class for 64
    // connections) are sized by it, and stay.
    rig.answered("warm");
    let plane = &rig.plane;
    wait_for("the warm-up to settle", || plane.stats().connections == 0 && plane.stats().active_calls == 0);
    // Its upstream connections were closed by the rig (`connection: close`).
    std::thread::sleep(Duration::from_millis(600));
    let before = used();

    // Answered; counted while held.
    let mut clients = rig.hold("ok");
    let held = used() - before;
    // Two per agent connection (hyper's write buffer and its read buffer),
    // two per upstream connection: 144 with hyper 1.12.
    assert!(held >= 2 * CALLS, "{CALLS} held calls hold {held} slots: each agent connection's two buffers are slots");
    rig.answer_all(CALLS);
    for c in &mut clients {
        assert!(read_status(c).starts_with("HTTP/1.1 200"));
    }
    for i in 0..CALLS {
        rig.plane.unregister(&format!("ok{i}"));
    }
    drop(clients);
    rig.settle(before);

    // Cancelled: the rollouts are unregistered while their calls are held.
    let mut clients = rig.hold("cancel");
    for i in 0..CALLS {
        rig.plane.unregister(&format!("cancel{i}"));
    }
    for c in &mut clients {
        assert!(read_status(c).starts_with("HTTP/1.1 410"));
    }
    drop(clients);
    rig.held.clear();
    rig.settle(before);

    // Left: the agents close their connections mid-call.
    let clients = rig.hold("left");
    for c in &clients {
        c.shutdown(Shutdown::Both).unwrap();
    }
    drop(clients);
    rig.held.clear();
    for i in 0..CALLS {
        rig.plane.unregister(&format!("left{i}"));
    }
    rig.settle(before);
}
