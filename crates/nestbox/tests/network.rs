//! Box networking seen from outside and from inside boxes: addresses on a bridge,
//! box-to-box traffic by address and by name, host-to-box traffic, published
//! ports, the none and host modes, clean removal (no veth, address or rule left),
//! many boxes at once, and bad input. Bandwidth shares, reservations and caps are
//! measured in crates/nestbox-net/tests/shaping.rs on the same code.

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

fn inspect(root: &TestRoot, name: &str) -> Value {
    serde_json::from_str(&root.ok(&["inspect", name])).unwrap()
}

fn address(root: &TestRoot, name: &str) -> String {
    inspect(root, name)["state"]["network"]["address"]
        .as_str()
        .unwrap_or_else(|| panic!("box {name} has an address"))
        .to_string()
}

fn host_veth(root: &TestRoot, name: &str) -> String {
    inspect(root, name)["state"]["network"]["host_veth"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A TCP echo-ish server answering "hello from NAME" on PORT, in box NAME.
fn server(root: &TestRoot, name: &str, opts: &[&str], port: u16) {
    let code = format!(
        "import socket\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         s.bind(('0.0.0.0', {port}))\ns.listen(16)\nprint('ready', flush=True)\n\
         while True:\n    c, _ = s.accept()\n    c.sendall(b'hello from {name}')\n    c.close()\n"
    );
    let mut args = vec!["run", "-d", "--name", name];
    args.extend_from_slice(opts);
    args.extend_from_slice(&["--", "python3", "-c", &code]);
    root.run(&args).ok();
    wait_for("the server to listen", Duration::from_secs(20), || {
        root.ok(&["logs", name]).contains("ready")
    });
}

const CLIENT: &str = "import socket, sys\n\
     s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)\n\
     print(s.recv(100).decode())";

fn host_connect(addr: &str, port: u16) -> String {
    let out = std::process::Command::new("python3")
        .args(["-c", CLIENT, addr, &port.to_string()])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn bridged_boxes_reach_each_other_by_address_and_name() {
    let Some(root) = TestRoot::new("bridged_boxes_reach_each_other_by_address_and_name") else {
        return;
    };
    server(&root, "alpha", &[], 7000);
    let addr = address(&root, "alpha");
    // Inside: eth0 with the address, a default route via the bridge.
    let out = root
        .sh(&["--name", "probe"], "cat /proc/net/route; cat /etc/hosts")
        .ok()
        .stdout;
    assert!(
        out.contains("eth0\t00000000"),
        "default route via eth0:\n{out}"
    );
    assert!(out.contains("alpha"), "alpha in the hosts file:\n{out}");
    // By address and by name, from another box.
    for target in [addr.as_str(), "alpha"] {
        let out = root
            .run(&["run", "--rm", "--", "python3", "-c", CLIENT, target, "7000"])
            .ok();
        assert_eq!(out.stdout.trim(), "hello from alpha", "via {target}");
    }
    // From the host.
    assert_eq!(host_connect(&addr, 7000), "hello from alpha");
    // Each box has its own address.
    server(&root, "beta", &[], 7000);
    assert_ne!(address(&root, "beta"), addr);
    root.ok(&["rm", "-f", "alpha", "beta", "probe"]);
}

#[test]
fn published_port_reaches_the_box() {
    let Some(root) = TestRoot::new("published_port_reaches_the_box") else {
        return;
    };
    let port = nestbox_testkit::unused_port(20000, 1000);
    let publish = format!("{port}:7001");
    server(&root, "pub", &["-p", &publish], 7001);
    assert_eq!(host_connect("127.0.0.1", port), "hello from pub");
    // The port is taken now: a second box asking for it is refused, nothing left.
    let out = root.run(&[
        "run", "-d", "--name", "dup", "-p", &publish, "--", "sleep", "60",
    ]);
    assert_error(&out, 125, &port.to_string());
    assert!(!root.ok(&["ps", "-a"]).contains("dup"));
    root.ok(&["rm", "-f", "pub"]);
    // Gone with the box.
    assert_ne!(host_connect("127.0.0.1", port), "hello from pub");
}

#[test]
fn rm_leaves_no_veth_address_or_rule() {
    let Some(root) = TestRoot::new("rm_leaves_no_veth_address_or_rule") else {
        return;
    };
    // The network's classes are counted below: no box shells (which hold
    // classes of their own) in this root.
    root.run(&["pool", "size", "0"]).ok();
    let port = nestbox_testkit::unused_port(21000, 1000);
    let publish = format!("{port}:80");
    root.run(&[
        "run",
        "-d",
        "--name",
        "gone",
        "-p",
        &publish,
        "--net-rate",
        "10mbit",
        "--",
        "sleep",
        "300",
    ])
    .ok();
    let veth = host_veth(&root, "gone");
    let addr = address(&root, "gone");
    assert!(std::path::Path::new("/sys/class/net").join(&veth).exists());
    // The host's end is a bridge port of an IPv4 network: no IPv6 address
    // (nor the routes that come with one) in the host's tables.
    let inet6 = std::fs::read_to_string("/proc/net/if_inet6").unwrap_or_default();
    assert!(
        !inet6
            .lines()
            .any(|l| l.split_whitespace().last() == Some(veth.as_str())),
        "{veth} has an IPv6 address:\n{inet6}"
    );
    root.ok(&["rm", "-f", "gone"]);
    assert!(
        !std::path::Path::new("/sys/class/net").join(&veth).exists(),
        "veth {veth} removed"
    );
    let net: Value = serde_json::from_str(&root.ok(&["network", "inspect", "default"])).unwrap();
    assert_eq!(
        net["boxes"].as_array().unwrap().len(),
        0,
        "no lease left: {net}"
    );
    let bridge = net["bridge"].as_str().unwrap().to_string();
    let rules = std::process::Command::new("nft")
        .args(["list", "table", "ip", &format!("nestbox-{bridge}")])
        .output()
        .unwrap();
    let rules = String::from_utf8_lossy(&rules.stdout);
    assert!(
        !rules.contains(&addr) && !rules.contains(&port.to_string()),
        "{rules}"
    );
    let classes = std::process::Command::new("tc")
        .args(["class", "show", "dev", &format!("{bridge}ifb")])
        .output()
        .unwrap();
    let classes = String::from_utf8_lossy(&classes.stdout).to_string();
    assert!(
        classes.lines().count() <= 2,
        "only the root classes remain:\n{classes}"
    );
}

#[test]
fn none_and_host_modes() {
    let Some(root) = TestRoot::new("none_and_host_modes") else {
        return;
    };
    let out = root
        .sh(&["--network", "none"], "ls /sys/class/net")
        .ok()
        .stdout;
    assert_eq!(out.split_whitespace().collect::<Vec<_>>(), ["lo"]);
    // Host mode shares the host's network namespace itself; none has its own.
    let host_ns = std::fs::read_link("/proc/self/ns/net").unwrap();
    let host_ns = host_ns.to_string_lossy();
    let inside = root.run(&[
        "run",
        "--network",
        "host",
        "--",
        "readlink",
        "/proc/self/ns/net",
    ]);
    assert_eq!(inside.ok().stdout.trim(), host_ns);
    let inside = root.run(&[
        "run",
        "--network",
        "none",
        "--",
        "readlink",
        "/proc/self/ns/net",
    ]);
    assert_ne!(inside.ok().stdout.trim(), host_ns);
    assert_error(
        &root.run(&["run", "--network", "nope", "--", "true"]),
        125,
        "unknown --network",
    );
    assert_error(
        &root.run(&["run", "--network", "none", "-p", "8080:80", "--", "true"]),
        125,
        "need --network bridge",
    );
    assert_error(
        &root.run(&["run", "--net-rate", "fast", "--", "true"]),
        125,
        "--net-rate",
    );
    assert_error(
        &root.run(&["run", "-p", "99999:80", "--", "true"]),
        125,
        "99999",
    );
}

#[test]
fn serial_fifty_boxes_up_at_once() {
    let Some(root) = TestRoot::new("serial_fifty_boxes_up_at_once") else {
        return;
    };
    let names: Vec<String> = (0..50).map(|i| format!("n{i}")).collect();
    for n in &names {
        root.run(&["run", "-d", "--name", n, "--", "sleep", "300"])
            .ok();
    }
    let mut addrs: Vec<String> = names.iter().map(|n| address(&root, n)).collect();
    addrs.sort();
    addrs.dedup();
    assert_eq!(addrs.len(), 50, "50 distinct addresses");
    // The last box reaches the first by name.
    let out = root
        .run(&[
            "exec",
            "n49",
            "--",
            "python3",
            "-c",
            "import socket; print(socket.gethostbyname('n0'))",
        ])
        .ok();
    assert_eq!(out.stdout.trim(), address(&root, "n0"));
    root.rm_all(names.iter().map(String::as_str));
}

/// The host-side veths on the root's bridge.
fn bridge_ports(root: &TestRoot) -> Vec<String> {
    let net: Value = serde_json::from_str(&root.ok(&["network", "inspect", "default"])).unwrap();
    let bridge = net["bridge"].as_str().unwrap().to_string();
    let mut ports: Vec<String> = std::fs::read_dir(format!("/sys/class/net/{bridge}/brif"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default();
    ports.sort();
    ports
}

fn pool_ready(root: &TestRoot) -> u64 {
    let net: Value = serde_json::from_str(&root.ok(&["network", "inspect", "default"])).unwrap();
    net["pool"]["ready"].as_u64().unwrap()
}

/// Mounts of this root's network pool still in the host's mount table.
fn pool_mounts(root: &TestRoot) -> Vec<String> {
    let pool = root.path().join("run/netpool");
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(pool.to_str().unwrap()))
        .map(str::to_string)
        .collect()
}

#[test]
fn pooled_namespaces_serve_new_boxes_and_leave_nothing() {
    let Some(root) = TestRoot::new("pooled_namespaces_serve_new_boxes_and_leave_nothing") else {
        return;
    };
    // The bridge's ports are counted below: no box shells (which hold veths
    // of their own) in this root.
    root.run(&["pool", "size", "0"]).ok();
    // Make the network, then a pool of two namespaces, attached ahead of time.
    root.run(&["run", "--rm", "--", "true"]).ok();
    wait_for(
        "the first box's veth to go",
        Duration::from_secs(20),
        || bridge_ports(&root).is_empty(),
    );
    let out = root.ok(&["network", "pool", "2"]);
    assert!(out.contains("pool size 2, 2 ready"), "{out}");
    let pooled = bridge_ports(&root);
    assert_eq!(pooled.len(), 2, "two veths on the bridge: {pooled:?}");
    assert_eq!(pool_mounts(&root).len(), 2);
    // `network inspect` lists no box for them.
    let net: Value = serde_json::from_str(&root.ok(&["network", "inspect", "default"])).unwrap();
    assert_eq!(net["boxes"].as_array().unwrap().len(), 0, "{net}");

    // A box with the default attachment takes one: its veth is a pooled one.
    server(&root, "pa", &[], 7002);
    let veth = host_veth(&root, "pa");
    assert!(pooled.contains(&veth), "{veth} not one of {pooled:?}");
    let addr = address(&root, "pa");
    assert_eq!(host_connect(&addr, 7002), "hello from pa");
    let out = root
        .run(&["run", "--rm", "--", "python3", "-c", CLIENT, "pa", "7002"])
        .ok();
    assert_eq!(
        out.stdout.trim(),
        "hello from pa",
        "by name from another box"
    );
    let inside = root
        .run(&["exec", "pa", "--", "cat", "/sys/class/net/eth0/address"])
        .ok();
    assert!(!inside.stdout.trim().is_empty());

    // A box with bandwidth options makes its own namespace.
    root.run(&[
        "run",
        "-d",
        "--name",
        "capped",
        "--net-rate",
        "50mbit",
        "--",
        "sleep",
        "300",
    ])
    .ok();
    assert!(!pooled.contains(&host_veth(&root, "capped")));

    // The pool is refilled in the background.
    wait_for("the pool to be refilled", Duration::from_secs(20), || {
        pool_ready(&root) == 2
    });

    // A box holding a pooled namespace whose monitor dies is collected by gc,
    // its namespace mount with it.
    root.run(&["run", "-d", "--name", "pk", "--", "sleep", "300"])
        .ok();
    let v = inspect(&root, "pk");
    let (monitor, init) = (
        v["state"]["monitor_pid"].as_i64().unwrap() as i32,
        v["state"]["init_pid"].as_i64().unwrap() as i32,
    );
    wait_for("the pool to be refilled", Duration::from_secs(20), || {
        pool_ready(&root) == 2
    });
    // SAFETY: kill has no memory-safety preconditions; the pids are the box's.
    unsafe {
        libc::kill(monitor, libc::SIGKILL);
        libc::kill(init, libc::SIGKILL);
    }
    wait_for("the box to be dead", Duration::from_secs(20), || {
        root.status("pk").as_deref() == Some("dead")
    });
    root.ok(&["gc"]);
    let id = v["id"].as_str().unwrap();
    assert!(
        !pool_mounts(&root).iter().any(|m| m.contains(id)),
        "gc left the namespace mount of {id}: {:?}",
        pool_mounts(&root)
    );
    // The namespaces waiting in the pool are no leftovers: gc keeps them.
    assert_eq!(pool_ready(&root), 2, "gc emptied the pool");

    // rm releases the box's veth (with its namespace, by the kernel).
    root.ok(&["rm", "-f", "pa", "capped"]);
    wait_for("pa's veth to go", Duration::from_secs(20), || {
        !std::path::Path::new("/sys/class/net").join(&veth).exists()
    });

    // Size 0 empties the pool: no veth, mount or lease left.
    wait_for("the pool to be refilled", Duration::from_secs(20), || {
        pool_ready(&root) == 2
    });
    let out = root.ok(&["network", "pool", "0"]);
    assert!(out.contains("pool size 0, 0 ready"), "{out}");
    wait_for("the pool's veths to go", Duration::from_secs(20), || {
        bridge_ports(&root).is_empty()
    });
    assert_eq!(pool_mounts(&root), Vec::<String>::new());
    let net: Value = serde_json::from_str(&root.ok(&["network", "inspect", "default"])).unwrap();
    assert_eq!(net["pool"]["ready"], 0, "{net}");

    // Bad size: one line, nothing changed.
    assert_error(&root.run(&["network", "pool", "1000"]), 125, "too large");
    // A pool left at removal is removed with the network (the root's cleanup
    // checks that the bridge and its table are gone).
    root.ok(&["network", "pool", "1"]);
    assert_eq!(pool_mounts(&root).len(), 1);
}

/// The pool ids holding an address on the root's default network.
fn pool_leases(root: &TestRoot) -> Vec<String> {
    let path = root.path().join("lib/network/default/state.json");
    let state: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut ids: Vec<String> = state["boxes"]
        .as_object()
        .unwrap()
        .keys()
        .filter(|id| id.starts_with("netpool-"))
        .cloned()
        .collect();
    ids.sort();
    ids
}

/// A pooled namespace gone without its address released (a claim or a
/// removal cut short by kill -9): `gc` releases the address, which no box and
/// no pool entry holds, and keeps the pool's intact entries. Before, every
/// pool id's address counted as live, so such an address stayed for good
/// (the stress suite met one after its kill cycles).
#[test]
fn gc_releases_a_pool_address_no_pooled_namespace_holds() {
    let Some(root) = TestRoot::new("gc_releases_a_pool_address_no_pooled_namespace_holds") else {
        return;
    };
    let out = root.ok(&["network", "pool", "2"]);
    assert!(out.contains("pool size 2, 2 ready"), "{out}");
    let leases = pool_leases(&root);
    assert_eq!(leases.len(), 2, "{leases:?}");
    // Take one entry away as a cut-short removal would: its namespace mount
    // and directory go, its address stays.
    let pool = root.path().join("run/netpool");
    let entry = std::fs::read_dir(&pool)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join("pool-id").exists())
        .expect("a ready entry");
    let gone = std::fs::read_to_string(entry.join("pool-id")).unwrap();
    let ns = entry.join("ns");
    let status = std::process::Command::new("umount")
        .arg(&ns)
        .status()
        .unwrap();
    assert!(status.success(), "umount {}", ns.display());
    std::fs::remove_dir_all(&entry).unwrap();
    assert_eq!(pool_leases(&root), leases, "the address is still leased");

    root.ok(&["gc"]);
    let kept = pool_leases(&root);
    assert!(
        !kept.contains(&gone.trim().to_string()),
        "gc left {gone}: {kept:?}"
    );
    assert_eq!(
        kept.len(),
        1,
        "gc kept the intact entry's address: {kept:?}"
    );
    assert_eq!(pool_ready(&root), 1);
    root.ok(&["network", "pool", "0"]);
}

/// `template rm` while a clone lives, then `rm -f` of that clone: the
/// template's box goes with its last clone (its monitor releases its address),
/// and `rm -f` returns only then, so `network rm` right after finds no box.
/// Before, `network rm` was refused ("still has 1 box(es)", the template's
/// box) and the bridge and table stayed.
#[test]
fn network_rm_right_after_a_removed_templates_last_clone() {
    let Some(root) = TestRoot::new("network_rm_right_after_a_removed_templates_last_clone") else {
        return;
    };
    root.ok(&["run", "-d", "--name", "t", "--", "sleep", "1000"]);
    root.ok(&["freeze", "t"]);
    root.ok(&["clone", "t", "-d", "--name", "c"]);
    root.ok(&["template", "rm", "t"]);
    root.ok(&["rm", "-f", "c"]);
    root.ok(&["network", "rm"]);
    let left: Value = serde_json::from_str(&root.ok(&["ps", "-a", "--json"])).unwrap();
    assert_eq!(left, serde_json::json!([]), "boxes left");
}

/// Python for a box: send raw Ethernet frames on `eth0` (the box has
/// CAP_NET_RAW, as in Docker's default set). `FRAMES` is a list of tuples:
/// `("udp", src_mac, dst_mac, src_ip, dst_ip, sport, dport, payload)`,
/// `("arp", src_mac, dst_mac, op, sender_mac, sender_ip, target_mac, target_ip)`
/// or `("ra", src_mac, prefix)` (an IPv6 router advertisement to all nodes,
/// offering `prefix`::/64 for address autoconfiguration). `"self"` as a MAC is
/// the box's own.
const SEND_FRAMES: &str = r#"
import socket, struct
def csum(b):
    if len(b) % 2: b += b'\0'
    s = sum(struct.unpack('!%dH' % (len(b) // 2), b))
    while s >> 16: s = (s & 0xffff) + (s >> 16)
    return ~s & 0xffff
own = open('/sys/class/net/eth0/address').read().strip()
def mac(m): return bytes.fromhex((own if m == 'self' else m).replace(':', ''))
def udp(smac, dmac, sip, dip, sport, dport, payload):
    u = struct.pack('!HHHH', sport, dport, 8 + len(payload), 0) + payload.encode()
    ip = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(u), 0, 0, 64, 17, 0,
                     socket.inet_aton(sip), socket.inet_aton(dip))
    ip = ip[:10] + struct.pack('!H', csum(ip)) + ip[12:]
    return mac(dmac) + mac(smac) + b'\x08\x00' + ip + u
def arp(smac, dmac, op, sha, spa, tha, tpa):
    body = struct.pack('!HHBBH', 1, 0x0800, 6, 4, op) + mac(sha) + socket.inet_aton(spa) \
        + mac(tha) + socket.inet_aton(tpa)
    return mac(dmac) + mac(smac) + b'\x08\x06' + body
def ra(smac, prefix):
    src = socket.inet_pton(socket.AF_INET6, 'fe80::1')
    dst = socket.inet_pton(socket.AF_INET6, 'ff02::1')
    pi = struct.pack('!BBBBIII', 3, 4, 64, 0xc0, 86400, 14400, 0) \
        + socket.inet_pton(socket.AF_INET6, prefix + '::')
    body = struct.pack('!BBHBBHII', 134, 0, 0, 64, 0, 1800, 0, 0) + pi
    pseudo = src + dst + struct.pack('!I3xB', len(body), 58)
    body = body[:2] + struct.pack('!H', csum(pseudo + body)) + body[4:]
    ip6 = struct.pack('!IHBB', 6 << 28, len(body), 58, 255) + src + dst
    return bytes.fromhex('333300000001') + mac(smac) + b'\x86\xdd' + ip6 + body
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(('eth0', 0))
for f in FRAMES:
    s.send({'udp': udp, 'arp': arp, 'ra': ra}[f[0]](*f[1:]))
print('sent', len(FRAMES), flush=True)
"#;

/// Send `frames` (Python tuples, see [`SEND_FRAMES`]) from box `name`.
fn send_frames(root: &TestRoot, name: &str, frames: &[String]) {
    let code = format!("FRAMES = [{}]\n{SEND_FRAMES}", frames.join(", "));
    let out = root.run(&["exec", name, "--", "python3", "-c", &code]).ok();
    assert!(out.stdout.contains("sent"), "{out}");
}

/// A UDP frame tuple for [`send_frames`].
#[allow(clippy::too_many_arguments)]
fn udp_frame(
    smac: &str,
    dmac: &str,
    sip: &str,
    dip: &str,
    sport: u16,
    dport: u16,
    payload: &str,
) -> String {
    format!("('udp', '{smac}', '{dmac}', '{sip}', '{dip}', {sport}, {dport}, '{payload}')")
}

/// The MAC of box `name`'s `eth0`, as it reads it.
fn box_mac(root: &TestRoot, name: &str) -> String {
    root.run(&["exec", name, "--", "cat", "/sys/class/net/eth0/address"])
        .ok()
        .stdout
        .trim()
        .to_string()
}

/// The default network's `inspect` JSON.
fn network(root: &TestRoot) -> Value {
    serde_json::from_str(&root.ok(&["network", "inspect", "default"])).unwrap()
}

/// The root's `inet` guard table as `nft` lists it ("" if there is none).
fn guard_table(root: &TestRoot) -> String {
    let bridge = network(root)["bridge"].as_str().unwrap().to_string();
    let out = std::process::Command::new("nft")
        .args(["list", "table", "inet", &format!("nestbox-{bridge}")])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Whether a datagram arrives on `sock` within a second; its text.
fn udp_arrival(sock: &std::net::UdpSocket) -> Option<String> {
    sock.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let mut buf = [0u8; 512];
    sock.recv(&mut buf)
        .ok()
        .map(|n| String::from_utf8_lossy(&buf[..n]).to_string())
}

/// A host TCP service on the gateway (as any service bound to 0.0.0.0 would
/// be reachable there), one bound to the host's loopback only, and a box
/// trying both, plain and through the `route_localnet` trick (a raw frame to
/// 127.0.0.1 addressed to the bridge's MAC): refused, unless the operator
/// allowed the port with `--allow-host-port`, and then on the gateway only.
/// Published ports and the host's own connections to a box keep working; after
/// `rm` no rule of the box is left.
#[test]
fn the_host_is_not_a_destination_unless_a_port_is_allowed() {
    let Some(root) = TestRoot::new("the_host_is_not_a_destination_unless_a_port_is_allowed") else {
        return;
    };
    let tcp_port = nestbox_testkit::unused_port(22000, 1000);
    let udp_port = nestbox_testkit::unused_port(23000, 1000);
    let pub_port = nestbox_testkit::unused_port(24000, 1000);
    let allow_tcp = tcp_port.to_string();
    let allow_udp = format!("{udp_port}/udp");
    let publish = format!("{pub_port}:7005");
    // A box that publishes a port (this also makes the network).
    server(&root, "pub", &["-p", &publish], 7005);
    server(&root, "plain", &[], 7006);
    server(
        &root,
        "allowed",
        &[
            "--allow-host-port",
            &allow_tcp,
            "--allow-host-port",
            &allow_udp,
        ],
        7007,
    );
    let net = network(&root);
    let gateway = net["gateway"].as_str().unwrap().to_string();
    let bridge = net["bridge"].as_str().unwrap().to_string();
    let bridge_mac = std::fs::read_to_string(format!("/sys/class/net/{bridge}/address"))
        .unwrap()
        .trim()
        .to_string();
    let allowed_json = inspect(&root, "allowed");
    assert_eq!(
        allowed_json["state"]["network"]["allow_host_ports"],
        serde_json::json!([
            {"port": tcp_port, "proto": "tcp"},
            {"port": udp_port, "proto": "udp"}
        ]),
        "{allowed_json}"
    );

    // The host's services: TCP on the gateway, UDP on the gateway and on loopback.
    let gw: std::net::Ipv4Addr = gateway.parse().unwrap();
    let tcp = std::net::TcpListener::bind((gw, tcp_port)).unwrap();
    tcp.set_nonblocking(true).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let served = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            use std::io::Write;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match tcp.accept() {
                    Ok((mut c, _)) => {
                        let _ = c.write_all(b"hello from the host");
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        })
    };
    let udp_gw = std::net::UdpSocket::bind((gw, udp_port)).unwrap();
    let udp_lo = std::net::UdpSocket::bind((std::net::Ipv4Addr::LOCALHOST, udp_port)).unwrap();

    let ask = |name: &str| {
        let out = root.run(&[
            "exec", name, "--", "python3", "-c", CLIENT, &gateway, &allow_tcp,
        ]);
        out.stdout.trim().to_string()
    };
    // Not allowed: refused at once (a reset), not answered.
    assert_eq!(ask("plain"), "", "a box reached the host's service");
    // Allowed: answered.
    assert_eq!(ask("allowed"), "hello from the host");

    // Raw frames to the bridge's MAC, UDP to the host's port on the gateway
    // and on loopback (route_localnet is on for the bridge).
    for name in ["plain", "allowed"] {
        let addr = address(&root, name);
        let to_gw = format!("{name} to the gateway");
        let to_lo = format!("{name} to loopback");
        send_frames(
            &root,
            name,
            &[udp_frame(
                "self",
                &bridge_mac,
                &addr,
                &gateway,
                40000,
                udp_port,
                &to_gw,
            )],
        );
        let got = udp_arrival(&udp_gw);
        if name == "allowed" {
            assert_eq!(got.as_deref(), Some(to_gw.as_str()));
        } else {
            assert_eq!(got, None, "{name} reached the host on the gateway");
        }
        send_frames(
            &root,
            name,
            &[udp_frame(
                "self",
                &bridge_mac,
                &addr,
                "127.0.0.1",
                40000,
                udp_port,
                &to_lo,
            )],
        );
        assert_eq!(
            udp_arrival(&udp_lo),
            None,
            "{name} reached the host's loopback"
        );
    }

    // Published ports still work: from the host, and from a box via the gateway.
    assert_eq!(host_connect("127.0.0.1", pub_port), "hello from pub");
    let out = root.run(&[
        "exec",
        "plain",
        "--",
        "python3",
        "-c",
        CLIENT,
        &gateway,
        &pub_port.to_string(),
    ]);
    assert_eq!(out.stdout.trim(), "hello from pub", "{out}");
    // The host still reaches a box.
    assert_eq!(
        host_connect(&address(&root, "plain"), 7006),
        "hello from plain"
    );

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    served.join().unwrap();
    let addr = address(&root, "allowed");
    assert!(guard_table(&root).contains(&addr), "{}", guard_table(&root));
    root.ok(&["rm", "-f", "allowed"]);
    let table = guard_table(&root);
    assert!(
        !table.contains(&addr) && !table.contains(&allow_tcp),
        "the box's rules are left:\n{table}"
    );
    assert!(table.contains("reject"), "the guard itself stays:\n{table}");
    // Bad input: one line, nothing made.
    assert_error(
        &root.run(&["run", "--allow-host-port", "99999", "--", "true"]),
        125,
        "invalid host port",
    );
    assert_error(
        &root.run(&["run", "--egress", "10.0.0.0/40", "--", "true"]),
        125,
        "invalid egress policy",
    );
    // The egress policy shows in inspect (enforced and logged: nestbox-net
    // bridge.rs, egress_policies_admit_only_what_they_list_and_log_their_decisions).
    root.run(&[
        "run", "-d", "--name", "eg", "--egress", "deny-all", "--", "sleep", "60",
    ])
    .ok();
    let eg = inspect(&root, "eg");
    assert_eq!(eg["state"]["network"]["egress"], "deny_all", "{eg}");
    root.ok(&["rm", "-f", "eg"]);
    assert_error(
        &root.run(&[
            "run",
            "--network",
            "none",
            "--allow-host-port",
            "80",
            "--",
            "true",
        ]),
        125,
        "need --network bridge",
    );
    root.ok(&["rm", "-f", "pub", "plain"]);
}

/// Spoofing from inside boxes with raw sockets: frames with another box's
/// source address or a forged source MAC, on the box-to-box shortcut
/// (unicast to a box), on the bridge (broadcast) and through the egress tree
/// (a capped box), a DHCP server's reply, an ARP reply claiming another box's
/// address, an IPv6 router advertisement. The receiving box gets the genuine
/// frames sent the same way and none of the forged ones; its ARP table keeps
/// the victim's real MAC and it autoconfigures no address from the
/// advertisement.
#[test]
fn spoofed_frames_from_a_box_are_dropped() {
    let Some(root) = TestRoot::new("spoofed_frames_from_a_box_are_dropped") else {
        return;
    };
    let listener = "import socket, select\n\
         socks = []\n\
         for p in (5555, 68):\n\
         \x20   s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         \x20   s.bind(('0.0.0.0', p))\n\
         \x20   socks.append(s)\n\
         print('ready', flush=True)\n\
         while True:\n\
         \x20   for s in select.select(socks, [], [])[0]:\n\
         \x20       d, a = s.recvfrom(2000)\n\
         \x20       print('got', a[0], d.decode(errors='replace'), flush=True)\n";
    root.run(&["run", "-d", "--name", "r", "--", "python3", "-c", listener])
        .ok();
    root.wait_logged("r", "ready", Duration::from_secs(20));
    for (name, opts) in [
        ("v", vec![]),
        ("s", vec![]),
        ("c", vec!["--net-rate", "1gbit"]),
    ] {
        let mut args = vec!["run", "-d", "--name", name];
        args.extend(opts);
        args.extend(["--", "sleep", "300"]);
        root.run(&args).ok();
    }
    let (r_ip, v_ip, s_ip, c_ip) = (
        address(&root, "r"),
        address(&root, "v"),
        address(&root, "s"),
        address(&root, "c"),
    );
    let (r_mac, v_mac, s_mac) = (
        box_mac(&root, "r"),
        box_mac(&root, "v"),
        box_mac(&root, "s"),
    );
    let bcast = "ff:ff:ff:ff:ff:ff";
    let fake_mac = "02:de:ad:be:ef:01";

    // ARP: r learns v's MAC (it sends to v), then s claims v's address, once
    // with its own MAC and once with v's; a genuine request from s is answered.
    root.run(&[
        "exec",
        "r",
        "--",
        "python3",
        "-c",
        &format!("import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('{v_ip}', 9))"),
    ])
    .ok();
    let arp_of = |ip: &str| -> Option<String> {
        let table = root
            .run(&["exec", "r", "--", "cat", "/proc/net/arp"])
            .ok()
            .stdout;
        table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(ip))
            .and_then(|l| l.split_whitespace().nth(3).map(str::to_string))
    };
    wait_for("r to learn v's MAC", Duration::from_secs(10), || {
        arp_of(&v_ip).as_deref() == Some(v_mac.as_str())
    });
    // Past the ARP lock time, when a reply may override the entry.
    std::thread::sleep(Duration::from_millis(1500));
    send_frames(
        &root,
        "s",
        &[
            format!("('arp', 'self', '{r_mac}', 2, 'self', '{v_ip}', '{r_mac}', '{r_ip}')"),
            format!("('arp', '{v_mac}', '{r_mac}', 2, '{v_mac}', '{v_ip}', '{r_mac}', '{r_ip}')"),
            format!(
                "('arp', 'self', '{bcast}', 1, 'self', '{s_ip}', '00:00:00:00:00:00', '{r_ip}')"
            ),
        ],
    );
    wait_for(
        "r to learn s's MAC from its request",
        Duration::from_secs(10),
        || arp_of(&s_ip).as_deref() == Some(s_mac.as_str()),
    );
    assert_eq!(
        arp_of(&v_ip),
        Some(v_mac.clone()),
        "r's entry for v changed"
    );

    // UDP: forged and genuine, on each path.
    let tag = std::process::id() % 0xffff;
    let prefix = format!("fd42:{tag:x}:1:2");
    send_frames(
        &root,
        "s",
        &[
            udp_frame(
                "self",
                &r_mac,
                &v_ip,
                &r_ip,
                4000,
                5555,
                "forged-ip-shortcut",
            ),
            udp_frame(
                fake_mac,
                &r_mac,
                &s_ip,
                &r_ip,
                4000,
                5555,
                "forged-mac-shortcut",
            ),
            udp_frame(
                "self",
                bcast,
                &v_ip,
                "255.255.255.255",
                4000,
                5555,
                "forged-ip-bridge",
            ),
            udp_frame(
                "self",
                bcast,
                &s_ip,
                "255.255.255.255",
                67,
                68,
                "dhcp-server",
            ),
            format!("('ra', 'self', '{prefix}')"),
            udp_frame("self", &r_mac, &s_ip, &r_ip, 4000, 5555, "genuine-shortcut"),
            udp_frame(
                "self",
                bcast,
                &s_ip,
                "255.255.255.255",
                4000,
                5555,
                "genuine-bridge",
            ),
            udp_frame(
                "self",
                bcast,
                &s_ip,
                "255.255.255.255",
                6700,
                68,
                "genuine-68",
            ),
        ],
    );
    send_frames(
        &root,
        "c",
        &[
            udp_frame("self", &r_mac, &v_ip, &r_ip, 4000, 5555, "forged-ip-capped"),
            udp_frame("self", &r_mac, &c_ip, &r_ip, 4000, 5555, "genuine-capped"),
        ],
    );
    for genuine in [
        "genuine-shortcut",
        "genuine-bridge",
        "genuine-68",
        "genuine-capped",
    ] {
        root.wait_log("r", genuine, Duration::from_secs(10));
    }
    // Forged frames were sent before the genuine ones, each on its path.
    std::thread::sleep(Duration::from_millis(500));
    let log = root.ok(&["logs", "r"]);
    assert!(
        log.contains(&format!("got {s_ip} genuine-shortcut")),
        "{log}"
    );
    assert!(log.contains(&format!("got {c_ip} genuine-capped")), "{log}");
    for forged in [
        "forged-ip-shortcut",
        "forged-mac-shortcut",
        "forged-ip-bridge",
        "dhcp-server",
        "forged-ip-capped",
    ] {
        assert!(!log.contains(forged), "{forged} arrived:\n{log}");
    }
    let inet6 = root
        .run(&["exec", "r", "--", "cat", "/proc/net/if_inet6"])
        .ok()
        .stdout;
    let autoconf = format!("fd42{tag:04x}00010002");
    assert!(
        !inet6.lines().any(|l| l.starts_with(&autoconf)),
        "r took an address from s's router advertisement:\n{inet6}"
    );
    root.ok(&["rm", "-f", "r", "v", "s", "c"]);
}

/// `network policy isolated`: a box reaches another only through its
/// published port on the gateway, the host still reaches every box, the
/// policy shows in `network inspect` and cannot change while boxes are on the
/// network.
#[test]
fn isolated_policy_keeps_boxes_apart() {
    let Some(root) = TestRoot::new("isolated_policy_keeps_boxes_apart") else {
        return;
    };
    assert_eq!(root.ok(&["network", "policy"]).trim(), "policy open");
    assert_eq!(
        root.ok(&["network", "policy", "isolated"]).trim(),
        "policy isolated"
    );
    let port = nestbox_testkit::unused_port(25000, 1000);
    let publish = format!("{port}:7010");
    server(&root, "b", &["-p", &publish], 7010);
    server(&root, "a", &[], 7011);
    let net = network(&root);
    assert_eq!(net["policy"]["box_to_box"], "isolated", "{net}");
    let gateway = net["gateway"].as_str().unwrap().to_string();
    let b_addr = address(&root, "b");
    let ask = |name: &str, to: &str, port: &str| {
        root.run(&["exec", name, "--", "python3", "-c", CLIENT, to, port])
            .stdout
            .trim()
            .to_string()
    };
    assert_eq!(ask("a", &b_addr, "7010"), "", "a reached b directly");
    assert_eq!(ask("a", "b", "7010"), "", "a reached b by name");
    assert_eq!(ask("a", &gateway, &port.to_string()), "hello from b");
    assert_eq!(host_connect(&b_addr, 7010), "hello from b");
    assert_error(
        &root.run(&["network", "policy", "open"]),
        125,
        "policy cannot change",
    );
    assert_error(
        &root.run(&["network", "policy", "closed"]),
        125,
        "unknown network policy",
    );
    root.ok(&["rm", "-f", "a", "b"]);
    assert_eq!(
        root.ok(&["network", "policy", "open"]).trim(),
        "policy open"
    );
}

/// `network inspect NAME` of a user-defined network.
fn network_named(root: &TestRoot, name: &str) -> Value {
    serde_json::from_str(&root.ok(&["network", "inspect", name])).unwrap()
}

/// What `ask` prints: a connection from box `from` (`exec`) to `to:port`,
/// the server's greeting or "" when refused or dropped.
fn ask_from(root: &TestRoot, from: &str, to: &str, port: u16) -> String {
    root.run(&[
        "exec",
        from,
        "--",
        "python3",
        "-c",
        CLIENT,
        to,
        &port.to_string(),
    ])
    .stdout
    .trim()
    .to_string()
}

/// Whether the host has a link or an nft table of `bridge`.
fn bridge_things(bridge: &str) -> Vec<String> {
    let mut left = Vec::new();
    for link in [bridge.to_string(), format!("{bridge}ifb")] {
        if std::path::Path::new("/sys/class/net").join(&link).exists() {
            left.push(format!("link {link}"));
        }
    }
    for family in ["ip", "inet"] {
        let ok = std::process::Command::new("nft")
            .args(["list", "table", family, &format!("nestbox-{bridge}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            left.push(format!("nft table {family} nestbox-{bridge}"));
        }
    }
    left
}

/// User-defined networks: each its own bridge, subnet and tables; boxes on
/// different networks (and on the default one) cannot reach each other, boxes
/// of one open network can; on an isolated one a box reaches another only
/// through a published port on the gateway. `network rm` is refused while a
/// box is on the network and leaves nothing; bad input gets one line and
/// makes nothing.
#[test]
fn user_defined_networks_keep_their_boxes_apart_and_leave_nothing() {
    let Some(root) =
        TestRoot::new("user_defined_networks_keep_their_boxes_apart_and_leave_nothing")
    else {
        return;
    };
    let made = root.ok(&["network", "create", "red"]);
    assert!(made.contains("network red bridge nbu"), "{made}");
    root.ok(&["network", "create", "blue"]);
    root.ok(&["network", "create", "jail", "--isolated"]);
    let red = network_named(&root, "red");
    let blue = network_named(&root, "blue");
    let jail = network_named(&root, "jail");
    let bridges: Vec<String> = [&red, &blue, &jail]
        .iter()
        .map(|n| n["bridge"].as_str().unwrap().to_string())
        .collect();
    // Each its own bridge and tables, made at once.
    for b in &bridges {
        assert_eq!(bridge_things(b).len(), 4, "{b}: {:?}", bridge_things(b));
    }
    assert_ne!(red["subnet"], blue["subnet"]);
    assert_eq!(jail["policy"]["box_to_box"], "isolated", "{jail}");
    assert_eq!(red["policy"]["box_to_box"], "open", "{red}");

    server(&root, "r1", &["--network", "red"], 7020);
    server(&root, "r2", &["--network", "red"], 7021);
    server(&root, "b1", &["--network", "blue"], 7022);
    server(&root, "d1", &[], 7023);
    let r1 = address(&root, "r1");
    let b1 = address(&root, "b1");
    let d1 = address(&root, "d1");
    let red_subnet: nestbox_net::Subnet = red["subnet"].as_str().unwrap().parse().unwrap();
    assert!(
        red_subnet.contains(r1.parse().unwrap()),
        "{r1} in {red_subnet}"
    );
    // One open network: boxes reach each other, by address and by name.
    assert_eq!(ask_from(&root, "r2", &r1, 7020), "hello from r1");
    assert_eq!(ask_from(&root, "r2", "r1", 7020), "hello from r1");
    // Across networks, either way, and to and from the default network: nothing.
    assert_eq!(ask_from(&root, "b1", &r1, 7020), "", "blue reached red");
    assert_eq!(ask_from(&root, "r1", &b1, 7022), "", "red reached blue");
    assert_eq!(ask_from(&root, "d1", &r1, 7020), "", "default reached red");
    assert_eq!(ask_from(&root, "r1", &d1, 7023), "", "red reached default");
    // The host reaches every box.
    assert_eq!(host_connect(&b1, 7022), "hello from b1");

    // Isolated: only the gateway, and what is published there.
    let port = nestbox_testkit::unused_port(26000, 1000);
    let publish = format!("{port}:7024");
    server(&root, "j1", &["--network", "jail", "-p", &publish], 7024);
    server(&root, "j2", &["--network", "jail"], 7025);
    let j1 = address(&root, "j1");
    let gateway = jail["gateway"].as_str().unwrap().to_string();
    assert_eq!(
        ask_from(&root, "j2", &j1, 7024),
        "",
        "j2 reached j1 directly"
    );
    assert_eq!(ask_from(&root, "j2", &gateway, port), "hello from j1");

    // `ls` lists them with their box counts.
    let ls: Value = serde_json::from_str(&root.ok(&["network", "ls", "--json"])).unwrap();
    let boxes = |name: &str| {
        ls.as_array()
            .unwrap()
            .iter()
            .find(|n| n["name"] == name)
            .map(|n| n["boxes"].clone())
    };
    assert_eq!(boxes("red"), Some(serde_json::json!(2)), "{ls}");
    assert_eq!(boxes("jail"), Some(serde_json::json!(2)), "{ls}");

    // Bad input: one line, nothing made.
    let red_subnet_text = red_subnet.to_string();
    for (args, fragment) in [
        (vec!["network", "create", "red"], "already exists"),
        (
            vec!["network", "create", "green", "--subnet", "10.1.2.0/33"],
            "invalid subnet",
        ),
        (
            vec!["network", "create", "green", "--subnet", &red_subnet_text],
            "overlaps network \"red\"",
        ),
        (vec!["network", "create", "bridge"], "reserved"),
        (vec!["network", "create", "a/b"], "invalid network name"),
        (
            vec!["network", "create", "green", "--egress", "10.0.0.0/40"],
            "invalid egress policy",
        ),
        (
            vec![
                "network",
                "create",
                "green",
                "--egress",
                "nothing-here.invalid",
            ],
            "does not resolve",
        ),
        (
            vec!["run", "--rm", "--network", "nope", "--", "true"],
            "unknown --network \"nope\": no network of that name",
        ),
        (vec!["network", "rm", "nope"], "no network named \"nope\""),
        (vec!["network", "rm", "red"], "still has 2 box(es)"),
    ] {
        assert_error(&root.run(&args), 125, fragment);
    }
    let ls2: Value = serde_json::from_str(&root.ok(&["network", "ls", "--json"])).unwrap();
    let names: Vec<&str> = ls2
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["name"].as_str())
        .collect();
    assert_eq!(names, ["blue", "default", "jail", "red"], "{ls2}");
    assert!(!root.ok(&["ps", "-a"]).contains("nope"));

    // rm: nothing of the network is left.
    root.ok(&["rm", "-f", "r1", "r2", "b1", "d1", "j1", "j2"]);
    for name in ["red", "blue", "jail"] {
        assert!(root.path().join("lib/network").join(name).exists());
        root.ok(&["network", "rm", name]);
        assert!(
            !root.path().join("lib/network").join(name).exists(),
            "state of {name} left"
        );
    }
    for b in &bridges {
        assert_eq!(bridge_things(b), Vec::<String>::new(), "{b} left things");
    }
}

/// A host beyond the network: a namespace joined to the host by a veth pair
/// (`nbo...`, 10.233.N.0/30), routed through the host like the internet, with
/// servers answering "hello from far" on the ports asked for.
struct Far {
    ns: String,
    link: String,
    far: String,
    servers: Vec<std::process::Child>,
}

fn sh_ok(cmd: &str) {
    let out = std::process::Command::new("sh")
        .args(["-ec", cmd])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Far {
    fn new(n: u8, ports: &[u16]) -> Far {
        let pid = std::process::id() % 10000;
        let ns = format!("nbtest{n}x{pid}");
        let link = format!("nbo{n}x{pid}");
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &ns])
            .output();
        sh_ok(&format!(
            "ip netns add {ns}; ip link add {link} type veth peer name eth0 netns {ns}; \
             ip addr add 10.233.{n}.1/30 dev {link}; ip link set {link} up; \
             echo 1 > /proc/sys/net/ipv4/conf/{link}/forwarding; \
             ip -n {ns} addr add 10.233.{n}.2/30 dev eth0; ip -n {ns} link set eth0 up; \
             ip -n {ns} link set lo up"
        ));
        let mut far = Far {
            ns,
            link,
            far: format!("10.233.{n}.2"),
            servers: Vec::new(),
        };
        for port in ports {
            let code = format!(
                "import socket\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
                 s.bind(('0.0.0.0', {port}))\ns.listen(16)\n\
                 while True:\n    c, _ = s.accept()\n    c.sendall(b'hello from far')\n    c.close()\n"
            );
            far.servers.push(
                std::process::Command::new("ip")
                    .args(["netns", "exec", &far.ns, "python3", "-c", &code])
                    .spawn()
                    .unwrap(),
            );
        }
        let far_addr = far.far.clone();
        for port in ports {
            let ns = far.ns.clone();
            wait_for("the far server to listen", Duration::from_secs(10), || {
                std::process::Command::new("ip")
                    .args(["netns", "exec", &ns, "python3", "-c", CLIENT, &far_addr])
                    .arg(port.to_string())
                    .output()
                    .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("hello"))
            });
        }
        far
    }
}

impl Drop for Far {
    fn drop(&mut self) {
        for s in &mut self.servers {
            let _ = s.kill();
            let _ = s.wait();
        }
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.ns])
            .output();
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.link])
            .output();
    }
}

/// A line `ADDRESS NAME` in the host's /etc/hosts for as long as it lives
/// (rewritten in place: /etc/hosts may be a bind mount).
struct HostsEntry {
    name: String,
}

impl HostsEntry {
    fn set(name: &str, addr: &str) -> HostsEntry {
        let e = HostsEntry {
            name: name.to_string(),
        };
        let mut text = e.without();
        text.push_str(&format!("{addr} {name}\n"));
        std::fs::write("/etc/hosts", text).unwrap();
        e
    }

    /// /etc/hosts without this entry's line.
    fn without(&self) -> String {
        let text = std::fs::read_to_string("/etc/hosts").unwrap();
        let mut out: String = text
            .lines()
            .filter(|l| l.split_whitespace().nth(1) != Some(self.name.as_str()))
            .map(|l| format!("{l}\n"))
            .collect();
        if out.is_empty() {
            out = "127.0.0.1 localhost\n".into();
        }
        out
    }
}

impl Drop for HostsEntry {
    fn drop(&mut self) {
        let _ = std::fs::write("/etc/hosts", self.without());
    }
}

/// Egress policies given on the command line, of a network (`network create
/// --egress`) and of a box (`run --egress`), with a host name the test puts
/// in /etc/hosts: a real connection from a box to a listed host and port is
/// admitted, to another port refused; a box's own policy and its network's
/// both apply; decisions are in the kernel log; `inspect` shows the policy
/// and what the name resolved to; after the name moves, `network refresh`
/// follows it.
#[test]
fn egress_allow_lists_with_host_names_admit_only_what_they_list() {
    let Some(root) = TestRoot::new("egress_allow_lists_with_host_names_admit_only_what_they_list")
    else {
        return;
    };
    let far = Far::new(7, &[9000, 9001]);
    let pid = std::process::id();
    let host = format!("far-{pid}.egress.test");
    let entry = HostsEntry::set(&host, &far.far);
    let net = format!("eg{pid}");
    let policy = format!("{host}:9000,192.0.2.0/24");
    root.ok(&["network", "create", &net, "--egress", &policy]);
    let inspect = network_named(&root, &net);
    assert_eq!(inspect["policy"]["egress"], policy.as_str(), "{inspect}");
    assert_eq!(
        inspect["egress_names"]["names"][&host],
        serde_json::json!([far.far]),
        "{inspect}"
    );
    let sleeper = |name: &str, opts: &[&str]| {
        let mut args = vec!["run", "-d", "--name", name];
        args.extend_from_slice(opts);
        args.extend_from_slice(&["--", "sleep", "1000"]);
        root.ok(&args);
    };
    sleeper("on-net", &["--network", &net]);
    let far_any = far.far.clone();
    sleeper("both", &["--network", &net, "--egress", &far_any]);
    let own = format!("{host}:9001");
    sleeper("own", &["--egress", &own]);
    sleeper("open", &[]);
    let hello = "hello from far";
    // The network's list: the name's port only.
    assert_eq!(ask_from(&root, "on-net", &far.far, 9000), hello);
    assert_eq!(ask_from(&root, "on-net", &far.far, 9001), "");
    // Box and network: the box admits any port of far, the network only 9000.
    assert_eq!(ask_from(&root, "both", &far.far, 9000), hello);
    assert_eq!(ask_from(&root, "both", &far.far, 9001), "");
    // A box's own list with the name, on the default network.
    assert_eq!(ask_from(&root, "own", &far.far, 9001), hello);
    assert_eq!(ask_from(&root, "own", &far.far, 9000), "");
    // No policy: both.
    assert_eq!(ask_from(&root, "open", &far.far, 9000), hello);
    assert_eq!(ask_from(&root, "open", &far.far, 9001), hello);
    let own_id = inspect_id(&root, "own");
    let log =
        String::from_utf8_lossy(&std::process::Command::new("dmesg").output().unwrap().stdout)
            .to_string();
    for line in [
        format!("nestbox-egress allow network={net} "),
        format!("nestbox-egress deny network={net} "),
        format!("nestbox-egress allow box={own_id} "),
        format!("nestbox-egress deny box={own_id} "),
    ] {
        assert!(log.contains(&line), "no {line:?} in the kernel log");
    }
    // The name moves away: refresh follows it, and the network's list no
    // longer admits far; back again, it does.
    drop(entry);
    let entry = HostsEntry::set(&host, "10.233.7.3");
    let out = root.ok(&["network", "refresh", &net]);
    assert!(out.contains("10.233.7.3"), "{out}");
    assert_eq!(ask_from(&root, "on-net", &far.far, 9000), "");
    assert_eq!(
        network_named(&root, &net)["egress_names"]["names"][&host],
        serde_json::json!(["10.233.7.3"])
    );
    drop(entry);
    let entry = HostsEntry::set(&host, &far.far);
    root.ok(&["network", "refresh"]);
    assert_eq!(ask_from(&root, "on-net", &far.far, 9000), hello);
    // A refresher left running follows the name on its own.
    let mut refresher = root.spawn(&["network", "refresh", "--every", "1"]);
    drop(entry);
    let _entry = HostsEntry::set(&host, "10.233.7.4");
    wait_for(
        "the refresher to follow the name",
        Duration::from_secs(20),
        || {
            network_named(&root, &net)["egress_names"]["names"][&host]
                == serde_json::json!(["10.233.7.4"])
        },
    );
    assert_eq!(ask_from(&root, "on-net", &far.far, 9000), "");
    let _ = refresher.kill();
    let _ = refresher.wait();
    root.ok(&["rm", "-f", "on-net", "both", "own", "open"]);
    let bridge = inspect["bridge"].as_str().unwrap().to_string();
    root.ok(&["network", "rm", &net]);
    assert_eq!(bridge_things(&bridge), Vec::<String>::new());
}

/// The id of box `name`.
fn inspect_id(root: &TestRoot, name: &str) -> String {
    let v = inspect(root, name);
    v["id"]
        .as_str()
        .or_else(|| v["state"]["id"].as_str())
        .unwrap()
        .to_string()
}

/// Clones for a sandbox service: a template started on an isolated network
/// passes the network to its clones, which then cannot reach each other (nor
/// the template) directly, while the host reaches each; `clone --network
/// NAME` puts a clone on another network instead (its address from that
/// network's subnet).
#[test]
fn clones_of_a_template_on_an_isolated_network_cannot_reach_each_other() {
    let Some(root) =
        TestRoot::new("clones_of_a_template_on_an_isolated_network_cannot_reach_each_other")
    else {
        return;
    };
    root.ok(&["network", "create", "tenants", "--isolated"]);
    root.ok(&["network", "create", "other"]);
    server(&root, "t", &["--network", "tenants"], 7030);
    root.ok(&["freeze", "t"]);
    root.ok(&["clone", "t", "-d", "--name", "c1"]);
    root.ok(&["clone", "t", "-d", "--name", "c2"]);
    root.ok(&["clone", "t", "-d", "--name", "c3", "--network", "other"]);
    let tenants = network_named(&root, "tenants");
    let other = network_named(&root, "other");
    let subnet =
        |n: &Value| -> nestbox_net::Subnet { n["subnet"].as_str().unwrap().parse().unwrap() };
    let (c1, c2, c3) = (
        address(&root, "c1"),
        address(&root, "c2"),
        address(&root, "c3"),
    );
    for a in [&c1, &c2] {
        assert!(
            subnet(&tenants).contains(a.parse().unwrap()),
            "{a} not in tenants"
        );
    }
    assert!(
        subnet(&other).contains(c3.parse().unwrap()),
        "{c3} not in other"
    );
    // Each clone serves (the template's listening socket, re-created).
    wait_for("the clones to serve", Duration::from_secs(20), || {
        host_connect(&c1, 7030) == "hello from t" && host_connect(&c2, 7030) == "hello from t"
    });
    assert_eq!(host_connect(&c3, 7030), "hello from t");
    // But never to each other.
    assert_eq!(ask_from(&root, "c1", &c2, 7030), "", "c1 reached c2");
    assert_eq!(ask_from(&root, "c2", &c1, 7030), "", "c2 reached c1");
    assert_eq!(
        ask_from(&root, "c1", &c3, 7030),
        "",
        "c1 reached c3 on another network"
    );
    assert_eq!(
        ask_from(&root, "c3", &c1, 7030),
        "",
        "c3 reached c1 on another network"
    );
    let show = root.ok(&["network", "inspect", "c1"]);
    assert!(show.contains("\"network\": \"tenants\""), "{show}");
    root.ok(&["rm", "-f", "c1", "c2", "c3"]);
    root.ok(&["template", "rm", "t"]);
    root.ok(&["network", "rm", "tenants"]);
    root.ok(&["network", "rm", "other"]);
}
