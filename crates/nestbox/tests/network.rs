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
    let port = 20000 + (std::process::id() % 20000) as u16;
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
    let port = 40000 + (std::process::id() % 20000) as u16;
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
