//! The in-process TCP proxy of a service: one listening socket on the host,
//! each accepted connection relayed to one active replica, chosen round-robin.
//!
//! Why a proxy rather than nftables load-balancing: rejuvenation needs to know
//! when a replica has no open connection left (draining), and a connection
//! whose replica vanished between the choice and the connect has to go to
//! another replica rather than fail. Both are plain facts inside a proxy; with
//! DNAT they would have to be read back from conntrack.
//!
//! A replica is chosen and its open-connection count raised under one lock,
//! the same lock under which the supervisor takes replicas out of the active
//! set ([`Balancer::retire`]); so once a retired replica's count is 0 it stays
//! 0, and the supervisor may remove it. One thread per connection relays
//! both directions (blocking `read`/`write`, half-closes passed on).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// How long a connect to a replica may take before the next one is tried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Relay buffer size.
const BUFFER: usize = 64 << 10;

/// One replica as the proxy sees it.
#[derive(Debug)]
pub struct Backend {
    /// Its box name.
    pub name: String,
    /// Where it listens.
    pub addr: SocketAddr,
    /// Connections relayed to it that are still open.
    pub open: AtomicUsize,
}

/// The set of replicas that take new connections, and the round-robin cursor.
#[derive(Debug, Default)]
pub struct Balancer {
    inner: Mutex<Inner>,
    /// Connections accepted in all.
    pub accepted: AtomicU64,
    /// Connections that found no replica to take them.
    pub failed: AtomicU64,
}

#[derive(Debug, Default)]
struct Inner {
    active: Vec<Arc<Backend>>,
    next: usize,
}

impl Balancer {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A relay thread that panicked holds no invariant half-done: the list
        // is replaced whole.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Let `b` take new connections.
    pub fn add(&self, b: Arc<Backend>) {
        self.lock().active.push(b);
    }

    /// Stop giving `name` new connections; returns it (with its open count,
    /// which can only fall from now on).
    pub fn retire(&self, name: &str) -> Option<Arc<Backend>> {
        let mut inner = self.lock();
        let i = inner.active.iter().position(|b| b.name == name)?;
        Some(inner.active.remove(i))
    }

    /// The names of the replicas taking new connections.
    pub fn active(&self) -> Vec<Arc<Backend>> {
        self.lock().active.clone()
    }

    /// The next replica after round-robin, its count raised; skipping those in
    /// `tried`.
    fn take(&self, tried: &[String]) -> Option<Arc<Backend>> {
        let mut inner = self.lock();
        let n = inner.active.len();
        for _ in 0..n {
            let i = inner.next % n;
            inner.next = inner.next.wrapping_add(1);
            let b = &inner.active[i];
            if !tried.contains(&b.name) {
                b.open.fetch_add(1, Ordering::SeqCst);
                return Some(b.clone());
            }
        }
        None
    }
}

/// Accept connections on `listener` until `stop` is set (and the listener is
/// shut down to wake the accept), relaying each to a replica of `balancer`.
pub fn serve(listener: TcpListener, balancer: Arc<Balancer>, stop: Arc<AtomicBool>) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(client) = conn else {
            // EMFILE and the like: the client sees its connection refused.
            std::thread::sleep(Duration::from_millis(5));
            continue;
        };
        balancer.accepted.fetch_add(1, Ordering::Relaxed);
        let b = balancer.clone();
        let spawned = std::thread::Builder::new()
            .name("relay".into())
            .stack_size(128 << 10)
            .spawn(move || relay(client, &b));
        if let Err(e) = spawned {
            tracing::warn!("service proxy: no thread for a connection: {e}");
        }
    }
}

/// Connect `client` to a replica (the next one if a connect fails) and relay
/// until both sides are done.
fn relay(client: TcpStream, balancer: &Balancer) {
    let mut tried = Vec::new();
    let (backend, server) = loop {
        let Some(b) = balancer.take(&tried) else {
            balancer.failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("service proxy: no replica accepted a connection (tried {tried:?})");
            return;
        };
        match TcpStream::connect_timeout(&b.addr, CONNECT_TIMEOUT) {
            Ok(s) => break (b, s),
            Err(e) => {
                tracing::warn!("service proxy: replica {} ({}): {e}", b.name, b.addr);
                b.open.fetch_sub(1, Ordering::SeqCst);
                tried.push(b.name.clone());
            }
        }
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let pair = (client.try_clone(), server.try_clone());
    if let (Ok(client2), Ok(server2)) = pair {
        let up = std::thread::Builder::new()
            .name("relay-up".into())
            .stack_size(128 << 10)
            .spawn(move || copy(client2, server2));
        copy(server, client);
        if let Ok(h) = up {
            let _ = h.join();
        }
    }
    backend.open.fetch_sub(1, Ordering::SeqCst);
}

/// Copy `from` to `to` until EOF or an error, then half-close `to`'s write side
/// (a reset is passed on as a close).
fn copy(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = vec![0u8; BUFFER];
    loop {
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    let _ = from.shutdown(Shutdown::Read);
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(name: &str) -> Arc<Backend> {
        Arc::new(Backend {
            name: name.into(),
            addr: "127.0.0.1:1".parse().unwrap(),
            open: AtomicUsize::new(0),
        })
    }

    #[test]
    fn round_robin_skips_the_tried_and_retired_count_only_falls() {
        let bal = Balancer::default();
        bal.add(backend("a"));
        bal.add(backend("b"));
        let first = bal.take(&[]).unwrap();
        let second = bal.take(&[]).unwrap();
        assert_ne!(first.name, second.name);
        let skip = bal.take(&["a".into()]).unwrap();
        assert_eq!(skip.name, "b");
        assert!(bal.take(&["a".into(), "b".into()]).is_none());
        let a = bal.retire("a").unwrap();
        assert_eq!(a.open.load(Ordering::SeqCst), 1);
        for _ in 0..4 {
            assert_eq!(bal.take(&[]).unwrap().name, "b");
        }
        assert_eq!(a.open.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn relays_both_ways_and_fails_over_to_a_live_replica() {
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let live = server.local_addr().unwrap();
        let echo = std::thread::spawn(move || {
            let (mut s, _) = server.accept().unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            s.write_all(&got).unwrap();
        });
        // A dead replica first (a port nothing listens on), then the live one.
        let dead = TcpListener::bind("127.0.0.1:0").unwrap();
        let dead_addr = dead.local_addr().unwrap();
        drop(dead);
        let bal = Arc::new(Balancer::default());
        for (name, addr) in [("dead", dead_addr), ("live", live)] {
            bal.add(Arc::new(Backend {
                name: name.into(),
                addr,
                open: AtomicUsize::new(0),
            }));
        }
        let front = TcpListener::bind("127.0.0.1:0").unwrap();
        let front_addr = front.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let (b2, s2) = (bal.clone(), stop.clone());
        std::thread::spawn(move || serve(front, b2, s2));
        let mut c = TcpStream::connect(front_addr).unwrap();
        c.write_all(b"ping").unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        let mut back = Vec::new();
        c.read_to_end(&mut back).unwrap();
        assert_eq!(back, b"ping");
        echo.join().unwrap();
        assert_eq!(bal.failed.load(Ordering::Relaxed), 0);
        stop.store(true, Ordering::SeqCst);
    }
}
