//! `DataPlane::shutdown_and_join`: when it returns, the runtime's tasks are
//! gone (the listener among them: its port can be bound again at once) and
//! the plane's state is dropped (the wakeup fd is closed).  The Python
//! binding's `close()` relies on both: no thread or fd outlives it.
#![cfg(not(loom))]

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use lowwater_dataplane::{Config, DataPlane};

#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOC: lowwater_dataplane::Allocator = lowwater_dataplane::Allocator;

/// Linux (/proc), as the data plane's eventfd.
fn fd_is_open(fd: i32) -> bool {
    std::path::Path::new(&format!("/proc/self/fd/{fd}")).exists()
}

#[test]
fn shutdown_and_join_frees_the_port_and_the_wakeup_fd() {
    let listen: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let plane = DataPlane::start(Config::new("http://127.0.0.1:9/v1"), listen).unwrap();
    plane.register("r0", "s0").unwrap();
    let addr = plane.local_addr();
    let fd = plane.queue().wakeup_fd();
    assert!(fd_is_open(fd));
    plane.shutdown_and_join(Duration::from_secs(10));
    TcpListener::bind(addr).expect("the listener is dropped once shutdown_and_join returns");
    // The only test of this binary: no other thread opens an fd that could reuse the number.
    assert!(!fd_is_open(fd), "the wakeup fd is closed with the plane's state");
}
