//! Helpers of the networking tests: a network with a unique bridge, subnet and
//! state directory that is destroyed on drop (also on panic), namespaces made
//! by the test, TCP traffic between them, and leftover checks.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nestbox_net::netlink::Netlink;
use nestbox_net::{link, netns, nft, tc, Network, NetworkConfig, Subnet};

/// Whether the tests can run (they need root for namespaces and links);
/// without root the test is skipped, which is a failure under `CI=true`.
pub fn root() -> bool {
    nestbox_testkit::require_root("networking test")
}

/// A network for one test: bridge `nbt<tag>-<pid>`, subnet `10.231.<tag>.0/24`
/// (or the one given), state in a temporary directory. Destroyed on drop.
pub struct TestNet {
    pub net: Option<Network>,
    pub dir: PathBuf,
    pub bridge: String,
}

impl TestNet {
    pub fn new(tag: u8) -> TestNet {
        Self::with(tag, &format!("10.231.{tag}.0/24"), |_| {})
    }

    pub fn with(tag: u8, subnet: &str, tweak: impl FnOnce(&mut NetworkConfig)) -> TestNet {
        let pid = std::process::id() % 10000;
        let bridge = format!("nbt{tag}x{pid}");
        let dir = std::env::temp_dir().join(format!("nestbox-net-test-{pid}-{tag}"));
        let _ = std::fs::remove_dir_all(&dir);
        let mut cfg = NetworkConfig::new(
            &format!("t{tag}"),
            &bridge,
            Subnet::parse(subnet).unwrap(),
            dir.clone(),
        );
        cfg.ip_forward = false;
        tweak(&mut cfg);
        let net = Network::open(cfg).unwrap();
        TestNet {
            net: Some(net),
            dir,
            bridge,
        }
    }

    pub fn net(&self) -> &Network {
        self.net.as_ref().unwrap()
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        if let Some(net) = self.net.take() {
            let bridge = net.config().bridge.clone();
            let _ = net.destroy();
            // The network's tables go with it (not asserted while a failing
            // test unwinds).
            if !std::thread::panicking() {
                assert_eq!(nft::list_table(&bridge).unwrap(), None, "NAT table left");
                assert_eq!(
                    nft::list_guard_table(&bridge).unwrap(),
                    None,
                    "guard table left"
                );
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A network namespace made by the test.
pub fn new_ns() -> OwnedFd {
    netns::create().unwrap()
}

/// A namespace standing for a host outside the network, reached through the
/// host over a veth pair on 10.232.`n`.0/30: the host side is `.1`, the far
/// side (`eth0` in `ns`) `.2`, with forwarding on the host side. The pair goes
/// when this is dropped.
pub struct Outside {
    pub ns: OwnedFd,
    pub host_side: Ipv4Addr,
    pub far: Ipv4Addr,
    link: String,
}

impl Outside {
    pub fn new(n: u8) -> Outside {
        let ns = new_ns();
        let link = format!("nbo{n}x{}", std::process::id() % 10000);
        let mut nl = Netlink::open().unwrap();
        let _ = link::delete(&mut nl, &link);
        let idx = link::create_veth(&mut nl, &link, None, "eth0", ns.as_fd(), None).unwrap();
        let outside = Outside {
            ns,
            host_side: Ipv4Addr::new(10, 232, n, 1),
            far: Ipv4Addr::new(10, 232, n, 2),
            link,
        };
        nestbox_net::addr::add(&mut nl, idx, &outside.link, outside.host_side, 30).unwrap();
        std::fs::write(
            format!("/proc/sys/net/ipv4/conf/{}/forwarding", outside.link),
            "1",
        )
        .unwrap();
        let far = outside.far;
        netns::run_in(outside.ns.as_fd(), || {
            let mut nl = Netlink::open()?;
            let i = link::index(&mut nl, "eth0")?.unwrap();
            nestbox_net::addr::add(&mut nl, i, "eth0", far, 30)?;
            link::set_up(&mut nl, i, "eth0")
        })
        .unwrap();
        outside
    }
}

impl Drop for Outside {
    fn drop(&mut self) {
        if let Ok(mut nl) = Netlink::open() {
            let _ = link::delete(&mut nl, &self.link);
        }
    }
}

/// Listen on `addr` (port 0: any) inside `ns` (`None`: the host).
pub fn listen(ns: Option<BorrowedFd<'_>>, addr: Ipv4Addr, port: u16) -> TcpListener {
    let bind = move || {
        TcpListener::bind(SocketAddrV4::new(addr, port)).map_err(|e| nestbox_net::NetError::Sys {
            call: format!("bind {addr}:{port}"),
            source: e,
        })
    };
    match ns {
        Some(ns) => netns::run_in(ns, bind).unwrap(),
        None => bind().unwrap(),
    }
}

/// Connect to `to` from inside `ns` (`None`: the host), with a timeout.
pub fn connect(ns: Option<BorrowedFd<'_>>, to: SocketAddr) -> std::io::Result<TcpStream> {
    let go = move || Ok(TcpStream::connect_timeout(&to, Duration::from_secs(3)));
    match ns {
        Some(ns) => netns::run_in(ns, go).unwrap(),
        None => go().unwrap(),
    }
}

/// Serve one connection on `l`: write the peer's address and close.
pub fn echo_peer_once(l: TcpListener) -> JoinHandle<()> {
    std::thread::spawn(move || {
        if let Ok((mut s, peer)) = l.accept() {
            let _ = s.write_all(peer.ip().to_string().as_bytes());
        }
    })
}

/// Connect, read what the server says.
pub fn ask(ns: Option<BorrowedFd<'_>>, to: SocketAddr) -> String {
    let mut s = connect(ns, to).unwrap_or_else(|e| panic!("connect {to}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// A sink counting bytes received on every connection it accepts.
pub struct Sink {
    pub addr: SocketAddr,
    pub counters: Vec<Arc<AtomicU64>>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Sink {
    /// Listen on `addr` in `ns` and count `n` connections separately (in accept order).
    pub fn new(ns: Option<BorrowedFd<'_>>, addr: Ipv4Addr, n: usize) -> Sink {
        Sink::on(ns, addr, 0, n)
    }

    /// [`Sink::new`] on port `port` (0: any).
    pub fn on(ns: Option<BorrowedFd<'_>>, addr: Ipv4Addr, port: u16, n: usize) -> Sink {
        let l = listen(ns, addr, port);
        let local = l.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let counters: Vec<_> = (0..n).map(|_| Arc::new(AtomicU64::new(0))).collect();
        let mut threads = Vec::new();
        let cs = counters.clone();
        let st = stop.clone();
        threads.push(std::thread::spawn(move || {
            let mut readers = Vec::new();
            for c in cs {
                let Ok((mut s, _)) = l.accept() else { break };
                let st = st.clone();
                readers.push(std::thread::spawn(move || {
                    s.set_read_timeout(Some(Duration::from_millis(200)))
                        .unwrap();
                    let mut buf = vec![0u8; 256 * 1024];
                    while !st.load(Ordering::Relaxed) {
                        match s.read(&mut buf) {
                            Ok(0) => break,
                            Ok(n) => {
                                c.fetch_add(n as u64, Ordering::Relaxed);
                            }
                            Err(e)
                                if e.kind() == std::io::ErrorKind::WouldBlock
                                    || e.kind() == std::io::ErrorKind::TimedOut => {}
                            Err(_) => break,
                        }
                    }
                }));
            }
            for r in readers {
                let _ = r.join();
            }
        }));
        Sink {
            addr: local,
            counters,
            stop,
            threads,
        }
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A sender writing as fast as it can to `to` from `ns` until `until`.
pub fn blast(ns: Option<BorrowedFd<'_>>, to: SocketAddr, until: Instant) -> JoinHandle<()> {
    let mut s = connect(ns, to).unwrap_or_else(|e| panic!("connect {to}: {e}"));
    std::thread::spawn(move || {
        s.set_write_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let buf = vec![0x5au8; 64 * 1024];
        while Instant::now() < until {
            match s.write(&buf) {
                Ok(_) => {}
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut => {}
                Err(_) => break,
            }
        }
    })
}

/// Bits per second each counter grew by over `window`, starting after `warmup`.
pub fn measure(counters: &[Arc<AtomicU64>], warmup: Duration, window: Duration) -> Vec<f64> {
    std::thread::sleep(warmup);
    let a: Vec<u64> = counters.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    let t0 = Instant::now();
    std::thread::sleep(window);
    let b: Vec<u64> = counters.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    let secs = t0.elapsed().as_secs_f64();
    a.iter()
        .zip(&b)
        .map(|(x, y)| (y - x) as f64 * 8.0 / secs)
        .collect()
}

/// The links whose master is the bridge of index `bridge`.
pub fn bridge_ports(nl: &mut Netlink, bridge: u32) -> Vec<String> {
    link::list(nl)
        .unwrap()
        .into_iter()
        .filter(|l| l.master == Some(bridge))
        .map(|l| l.name)
        .collect()
}

/// Assert that nothing of any box is left: no veth on the bridge, no class on
/// the IFB but the link class, no published port in the NAT table, no allowed
/// host port in the guard table.
pub fn assert_no_box_leftovers(t: &TestNet) {
    let mut nl = Netlink::open().unwrap();
    let cfg = t.net().config();
    if let Some(br) = link::index(&mut nl, &cfg.bridge).unwrap() {
        let on_bridge = bridge_ports(&mut nl, br);
        assert!(
            on_bridge.is_empty(),
            "links left on the bridge: {on_bridge:?}"
        );
    }
    if let Some(ifb) = link::index(&mut nl, &cfg.ifb()).unwrap() {
        let classes: Vec<_> = tc::list_classes(&mut nl, ifb)
            .unwrap()
            .into_iter()
            .map(|c| tc::handle_str(c.handle))
            .filter(|h| h != "1:1" && h != "1:ffff")
            .collect();
        assert!(classes.is_empty(), "classes left on the IFB: {classes:?}");
        let filters = tc::list_class_filters(&mut nl, ifb, tc::handle(1, 0)).unwrap();
        assert!(filters.is_empty(), "filters left on the IFB: {filters:?}");
    }
    if let Some(table) = nft::list_table(&cfg.bridge).unwrap() {
        assert!(!table.contains("dnat to"), "published ports left:\n{table}");
    }
    if let Some(table) = nft::list_guard_table(&cfg.bridge).unwrap() {
        assert!(
            !table.contains(" dport ") && !table.contains("egress_"),
            "allowed host ports or egress chains left:\n{table}"
        );
    }
    assert!(t.net().leases().unwrap().is_empty(), "leases left");
    let hosts = std::fs::read_to_string(t.net().hosts_path()).unwrap_or_default();
    let gw = cfg.subnet.gateway().to_string();
    let boxes: Vec<_> = hosts
        .lines()
        .filter(|l| !l.starts_with('#') && !l.contains("localhost") && !l.starts_with(&gw))
        .collect();
    assert!(boxes.is_empty(), "hosts entries left: {boxes:?}");
}

/// Interfaces inside `ns`.
pub fn links_in(ns: BorrowedFd<'_>) -> Vec<String> {
    netns::run_in(ns, || {
        let mut nl = Netlink::open()?;
        Ok(link::list(&mut nl)?.into_iter().map(|l| l.name).collect())
    })
    .unwrap()
}

pub fn fd(o: &OwnedFd) -> BorrowedFd<'_> {
    o.as_fd()
}
