//! Bridge networking as root, on namespaces the tests make: addresses and
//! routes, box-to-box (also as boxes come and go) and host-to-box traffic, names, published ports,
//! masquerade, detach and gc leaving nothing behind, 50 boxes at once, and the
//! bad inputs. Each test has its own bridge, subnet and state directory.

mod common;

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use common::*;
use nestbox_net::netlink::Netlink;
use nestbox_net::{
    addr, link, netns, nft, parse_rate, AttachOptions, Egress, HostPort, NetError, NetErrorKind,
    Network, NetworkConfig, PortMapping,
};

fn sa(a: Ipv4Addr, p: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(a, p))
}

#[test]
fn attach_gives_address_route_and_connectivity() {
    if !root() {
        return;
    }
    let t = TestNet::new(1);
    let net = t.net();
    let (ns_a, ns_b) = (new_ns(), new_ns());
    let a = net.allocate("box-a", &["alpha"]).unwrap();
    let b = net.allocate("box-b", &["beta"]).unwrap();
    assert_ne!(a.address, b.address);
    assert_eq!(a.gateway, Ipv4Addr::new(10, 231, 1, 1));
    let att = net
        .attach(&a, ns_a.as_fd(), &AttachOptions::default())
        .unwrap();
    // Box b may reach the host's port 7002/tcp (on the gateway), nothing else.
    let allowed = AttachOptions {
        allow_host: vec![HostPort::parse("7002/tcp").unwrap()],
        ..Default::default()
    };
    net.attach(&b, ns_b.as_fd(), &allowed).unwrap();
    assert_eq!(att.lease.address, a.address);
    assert_eq!(att.class, format!("1:{:x}", a.address.octets()[3]));

    // Inside: eth0 with the address, a default route via the gateway.
    let (addrs, routes) = netns::run_in(ns_a.as_fd(), || {
        let mut nl = Netlink::open()?;
        let idx = link::index(&mut nl, "eth0")?.unwrap();
        Ok((
            addr::list(&mut nl, idx)?,
            nestbox_net::route::list_main(&mut nl)?,
        ))
    })
    .unwrap();
    assert_eq!(addrs, vec![(a.address, 24)]);
    assert!(
        routes.iter().any(|r| r.prefix == 0),
        "no default route: {routes:?}"
    );

    // Box to box by address.
    let l = listen(Some(ns_b.as_fd()), b.address, 7000);
    let srv = echo_peer_once(l);
    assert_eq!(
        ask(Some(ns_a.as_fd()), sa(b.address, 7000)),
        a.address.to_string()
    );
    srv.join().unwrap();

    // Host to box.
    let l = listen(Some(ns_a.as_fd()), Ipv4Addr::UNSPECIFIED, 7001);
    let srv = echo_peer_once(l);
    assert_eq!(ask(None, sa(a.address, 7001)), a.gateway.to_string());
    srv.join().unwrap();

    // Box to host (the gateway): refused, but for the port box b was allowed.
    let l = listen(None, a.gateway, 7002);
    let refused = connect(Some(ns_a.as_fd()), sa(a.gateway, 7002));
    assert!(refused.is_err(), "box a reached the host: {refused:?}");
    let srv = echo_peer_once(l);
    assert_eq!(
        ask(Some(ns_b.as_fd()), sa(a.gateway, 7002)),
        b.address.to_string()
    );
    srv.join().unwrap();

    let list = net.attachments().unwrap();
    assert_eq!(list.len(), 2);
}

#[test]
fn boxes_reach_each_other_whatever_order_they_come_and_go_in() {
    if !root() {
        return;
    }
    // Box-to-box traffic of uncapped boxes takes the shortcut, whose map is made
    // by the first uncapped box and goes when the last one does: a capped box
    // attached before it, and boxes attached after it went, are reachable.
    let t = TestNet::new(16);
    let net = t.net();
    let capped = AttachOptions {
        rate: Some(parse_rate("1gbit").unwrap()),
        ..Default::default()
    };
    let (ns_c, ns_a, ns_b) = (new_ns(), new_ns(), new_ns());
    let c = net.allocate("box-c", &[]).unwrap();
    net.attach(&c, ns_c.as_fd(), &capped).unwrap();
    let a = net.allocate("box-a", &[]).unwrap();
    net.attach(&a, ns_a.as_fd(), &AttachOptions::default())
        .unwrap();
    let check = |from: &std::os::fd::OwnedFd, fa: Ipv4Addr, to: &std::os::fd::OwnedFd, ta| {
        let l = listen(Some(to.as_fd()), ta, 7100);
        let srv = echo_peer_once(l);
        assert_eq!(ask(Some(from.as_fd()), sa(ta, 7100)), fa.to_string());
        srv.join().unwrap();
    };
    check(&ns_a, a.address, &ns_c, c.address);
    check(&ns_c, c.address, &ns_a, a.address);
    net.detach("box-a").unwrap();
    let b = net.allocate("box-b", &[]).unwrap();
    net.attach(&b, ns_b.as_fd(), &AttachOptions::default())
        .unwrap();
    check(&ns_b, b.address, &ns_c, c.address);
    check(&ns_c, c.address, &ns_b, b.address);
    // Again into the namespace that held box-a: a new veth, a new index.
    let a2 = net.allocate("box-a2", &[]).unwrap();
    net.attach(&a2, ns_a.as_fd(), &AttachOptions::default())
        .unwrap();
    check(&ns_b, b.address, &ns_a, a2.address);
    check(&ns_a, a2.address, &ns_b, b.address);
    for id in ["box-a2", "box-b", "box-c"] {
        net.detach(id).unwrap();
    }
    assert_no_box_leftovers(&t);
}

#[test]
fn names_resolve_through_the_shared_hosts_file() {
    if !root() {
        return;
    }
    let t = TestNet::new(2);
    let net = t.net();
    let (ns_a, ns_b) = (new_ns(), new_ns());
    let a = net.allocate("box-a", &["web", "web.box"]).unwrap();
    let hosts_inode = std::fs::metadata(net.hosts_path()).map(|m| {
        use std::os::unix::fs::MetadataExt;
        m.ino()
    });
    let b = net.allocate("box-b", &["db"]).unwrap();
    net.attach(&a, ns_a.as_fd(), &AttachOptions::default())
        .unwrap();
    net.attach(&b, ns_b.as_fd(), &AttachOptions::default())
        .unwrap();
    let hosts = std::fs::read_to_string(net.hosts_path()).unwrap();
    assert!(
        hosts.contains(&format!("{}\tweb web.box\n", a.address)),
        "{hosts}"
    );
    assert!(hosts.contains(&format!("{}\tdb\n", b.address)), "{hosts}");
    // Updated in place: a bind mount of it would see the new entries.
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        hosts_inode.unwrap(),
        std::fs::metadata(net.hosts_path()).unwrap().ino()
    );
    assert!(net.resolv_path().exists());
    // Resolve "db" the way a resolver reading the file would, and connect.
    let db: Ipv4Addr = hosts
        .lines()
        .find(|l| l.split_whitespace().skip(1).any(|n| n == "db"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    let l = listen(Some(ns_b.as_fd()), Ipv4Addr::UNSPECIFIED, 5432);
    let srv = echo_peer_once(l);
    assert_eq!(ask(Some(ns_a.as_fd()), sa(db, 5432)), a.address.to_string());
    srv.join().unwrap();
    net.detach("box-b").unwrap();
    let hosts = std::fs::read_to_string(net.hosts_path()).unwrap();
    assert!(!hosts.contains("\tdb\n"), "{hosts}");
}

#[test]
fn published_port_reaches_the_box() {
    if !root() {
        return;
    }
    let t = TestNet::new(3);
    let net = t.net();
    let (ns_a, ns_b) = (new_ns(), new_ns());
    let a = net.allocate("box-a", &["a"]).unwrap();
    let b = net.allocate("box-b", &["b"]).unwrap();
    let host_port = nestbox_testkit::unused_port(20000, 500);
    let opts = AttachOptions {
        publish: vec![PortMapping::parse(&format!("{host_port}:80/tcp")).unwrap()],
        ..Default::default()
    };
    net.attach(&a, ns_a.as_fd(), &opts).unwrap();
    net.attach(&b, ns_b.as_fd(), &AttachOptions::default())
        .unwrap();
    let table = nft::list_table(&t.bridge).unwrap().unwrap();
    assert!(
        table.contains(&format!("dnat to {}:80", a.address)),
        "{table}"
    );

    // From the host via localhost, via the gateway address, and from another box.
    for (from, to, expect) in [
        (None, Ipv4Addr::LOCALHOST, a.gateway),
        (None, a.gateway, a.gateway),
        (Some(ns_b.as_fd()), a.gateway, a.gateway),
    ] {
        let l = listen(Some(ns_a.as_fd()), Ipv4Addr::UNSPECIFIED, 80);
        let srv = echo_peer_once(l);
        let seen = ask(from, sa(to, host_port));
        assert_eq!(seen, expect.to_string(), "to {to}:{host_port}");
        srv.join().unwrap();
    }
    // The same host port cannot be published twice.
    let c = net.allocate("box-c", &[]).unwrap();
    let ns_c = new_ns();
    let err = net.attach(&c, ns_c.as_fd(), &opts).unwrap_err();
    assert!(
        err.to_string().contains("already in use by box box-a"),
        "{err}"
    );
    net.detach("box-c").unwrap();
    net.detach("box-a").unwrap();
    let table = nft::list_table(&t.bridge).unwrap().unwrap();
    assert!(!table.contains("dnat to"), "{table}");
    assert!(table.contains("masquerade"), "{table}");
}

#[test]
fn outbound_traffic_is_masqueraded() {
    if !root() {
        return;
    }
    let t = TestNet::new(4);
    let net = t.net();
    // An "outside" namespace reached through the host on another subnet.
    let out = Outside::new(4);
    let (outside, host_side, far) = (&out.ns, out.host_side, out.far);

    let ns = new_ns();
    let a = net.allocate("box-a", &["a"]).unwrap();
    net.attach(&a, ns.as_fd(), &AttachOptions::default())
        .unwrap();
    let l = listen(Some(outside.as_fd()), far, 9000);
    let srv = echo_peer_once(l);
    // The outside sees the host's address, not the box's.
    assert_eq!(ask(Some(ns.as_fd()), sa(far, 9000)), host_side.to_string());
    srv.join().unwrap();
}

#[test]
fn detach_leaves_no_veth_address_rule_or_class() {
    if !root() {
        return;
    }
    let t = TestNet::new(5);
    let net = t.net();
    let ns = new_ns();
    let a = net.allocate("box-a", &["a"]).unwrap();
    let host_port = nestbox_testkit::unused_port(20500, 500);
    let opts = AttachOptions {
        publish: vec![PortMapping::parse(&format!("{host_port}:80/udp")).unwrap()],
        rate: Some(parse_rate("100mbit").unwrap()),
        reserve: Some(parse_rate("10mbit").unwrap()),
        share: Some(300),
        ingress_rate: Some(parse_rate("50mbit").unwrap()),
        allow_host: vec![HostPort::parse("7070/udp").unwrap()],
        egress: Egress::parse("192.0.2.0/24:53").unwrap(),
    };
    let att = net.attach(&a, ns.as_fd(), &opts).unwrap();
    let guard = nft::list_guard_table(&t.bridge).unwrap().unwrap();
    assert!(
        guard.contains(&format!(
            "ip saddr {} ip daddr {} udp dport 7070 accept",
            a.address, a.gateway
        )),
        "{guard}"
    );
    let mut nl = Netlink::open().unwrap();
    let vidx = link::index(&mut nl, &att.host_veth).unwrap().unwrap();
    let qdiscs = nestbox_net::tc::list_qdiscs(&mut nl, vidx).unwrap();
    assert!(qdiscs.iter().any(|q| q.kind == "htb"), "{qdiscs:?}");
    assert!(qdiscs.iter().any(|q| q.kind == "ingress"), "{qdiscs:?}");
    assert!(links_in(ns.as_fd()).contains(&"eth0".to_string()));

    assert!(net.detach("box-a").unwrap());
    assert_eq!(link::index(&mut nl, &att.host_veth).unwrap(), None);
    assert!(!links_in(ns.as_fd()).contains(&"eth0".to_string()));
    assert_no_box_leftovers(&t);
    // Idempotent.
    assert!(!net.detach("box-a").unwrap());
    // The address is free again (not reused at once: round-robin), the pool intact.
    let again = net.allocate("box-a2", &[]).unwrap();
    assert_ne!(again.address, a.address);
    net.detach("box-a2").unwrap();
    assert_no_box_leftovers(&t);
}

#[test]
fn gc_removes_dead_boxes_and_orphans() {
    if !root() {
        return;
    }
    let t = TestNet::new(6);
    let net = t.net();
    let (ns_a, ns_b, ns_o) = (new_ns(), new_ns(), new_ns());
    let a = net.allocate("box-a", &["a"]).unwrap();
    let b = net.allocate("box-b", &["b"]).unwrap();
    net.attach(&a, ns_a.as_fd(), &AttachOptions::default())
        .unwrap();
    let hp = nestbox_testkit::unused_port(21000, 500);
    let opts = AttachOptions {
        publish: vec![PortMapping::parse(&format!("{hp}:1")).unwrap()],
        ..Default::default()
    };
    net.attach(&b, ns_b.as_fd(), &opts).unwrap();
    // An orphan veth on the bridge that no box owns (as after a crash).
    let mut nl = Netlink::open().unwrap();
    let br = link::index(&mut nl, &t.bridge).unwrap().unwrap();
    let orphan = format!("nbo6x{}", std::process::id() % 10000);
    link::create_veth(&mut nl, &orphan, Some(br), "eth0", ns_o.as_fd(), None).unwrap();

    let removed = net.gc(&["box-a"]).unwrap();
    assert_eq!(removed, vec!["box-b".to_string()]);
    assert_eq!(link::index(&mut nl, &orphan).unwrap(), None);
    assert_eq!(net.leases().unwrap().len(), 1);
    assert!(links_in(ns_a.as_fd()).contains(&"eth0".to_string()));
    assert!(!links_in(ns_b.as_fd()).contains(&"eth0".to_string()));
    net.gc(&[]).unwrap();
    assert_no_box_leftovers(&t);
}

#[test]
fn fifty_boxes_at_once() {
    if !root() {
        return;
    }
    let t = TestNet::new(7);
    let net = t.net();
    let mut boxes = Vec::new();
    let mut times = Vec::new();
    for i in 0..50 {
        let ns = new_ns();
        let id = format!("box-{i}");
        let lease = net.allocate(&id, &[&format!("b{i}")]).unwrap();
        let t0 = Instant::now();
        net.attach(&lease, ns.as_fd(), &AttachOptions::default())
            .unwrap();
        times.push(t0.elapsed());
        boxes.push((ns, lease));
    }
    times.sort();
    eprintln!(
        "attach latency over 50 boxes: median {:?}, max {:?}",
        times[25], times[49]
    );
    let addrs: BTreeSet<_> = boxes.iter().map(|(_, l)| l.address).collect();
    assert_eq!(addrs.len(), 50);
    // Every box reachable from the host; the first reaches the last.
    for (ns, lease) in &boxes {
        let l = listen(Some(ns.as_fd()), lease.address, 7100);
        let srv = echo_peer_once(l);
        assert_eq!(
            ask(None, sa(lease.address, 7100)),
            lease.gateway.to_string()
        );
        srv.join().unwrap();
    }
    let (ns0, l0) = &boxes[0];
    let (ns49, l49) = &boxes[49];
    let l = listen(Some(ns49.as_fd()), l49.address, 7101);
    let srv = echo_peer_once(l);
    assert_eq!(
        ask(Some(ns0.as_fd()), sa(l49.address, 7101)),
        l0.address.to_string()
    );
    srv.join().unwrap();
    for (_, lease) in &boxes {
        net.detach(&lease.box_id).unwrap();
    }
    assert_no_box_leftovers(&t);
}

#[test]
fn concurrent_allocations_never_share_an_address() {
    if !root() {
        return;
    }
    let t = TestNet::new(8);
    let cfg = t.net().config().clone();
    let handles: Vec<_> = (0..6)
        .map(|w| {
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                let net = Network::open(cfg).unwrap();
                (0..15)
                    .map(|i| net.allocate(&format!("w{w}-{i}"), &[]).unwrap().address)
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let all: Vec<Ipv4Addr> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    let unique: BTreeSet<_> = all.iter().collect();
    assert_eq!(all.len(), 90);
    assert_eq!(unique.len(), 90);
    // Persistent: a new handle sees them.
    let again = Network::open(cfg).unwrap();
    assert_eq!(again.leases().unwrap().len(), 90);
    assert_eq!(again.allocate("w0-0", &[]).unwrap().address, all[0]);
}

#[test]
fn host_port_in_use_is_refused_and_nothing_is_left() {
    if !root() {
        return;
    }
    let t = TestNet::new(9);
    let net = t.net();
    let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let ns = new_ns();
    let a = net.allocate("box-a", &[]).unwrap();
    let opts = AttachOptions {
        publish: vec![PortMapping::parse(&format!("{port}:80")).unwrap()],
        ..Default::default()
    };
    let err = net.attach(&a, ns.as_fd(), &opts).unwrap_err();
    let msg = err.to_string();
    assert_eq!(
        msg,
        format!("box box-a: host port {port}/tcp is already in use")
    );
    assert!(!links_in(ns.as_fd()).contains(&"eth0".to_string()));
    assert!(net.attachments().unwrap().is_empty());
    net.detach("box-a").unwrap();
    assert_no_box_leftovers(&t);
}

#[test]
fn failure_after_links_exist_rolls_everything_back() {
    if !root() {
        return;
    }
    let t = TestNet::new(10);
    let net = t.net();
    let ns = new_ns();
    let a = net.allocate("box-a", &[]).unwrap();
    // An eth0 already in the namespace makes the veth creation fail...
    let (ns2, b) = (new_ns(), net.allocate("box-b", &[]).unwrap());
    net.attach(&b, ns2.as_fd(), &AttachOptions::default())
        .unwrap();
    let err = net
        .attach(&a, ns2.as_fd(), &AttachOptions::default())
        .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("box box-a: netlink: create veth"),
        "{err}"
    );
    // ... and a box whose ingress cap cannot be set up fails after its veth,
    // address, route and class exist: all of it is removed again.
    let huge = AttachOptions {
        ingress_rate: Some(nestbox_net::Rate::from_bits(u64::MAX / 2).unwrap()),
        ..Default::default()
    };
    match net.attach(&a, ns.as_fd(), &huge) {
        Ok(_) => {
            // The kernel took it: then there is no late failure to provoke here.
            net.detach("box-a").unwrap();
        }
        Err(e) => {
            eprintln!("late failure: {e}");
            assert!(!links_in(ns.as_fd()).contains(&"eth0".to_string()));
            assert!(net
                .attachments()
                .unwrap()
                .iter()
                .all(|x| x.lease.box_id != "box-a"));
            net.detach("box-a").unwrap();
        }
    }
    net.detach("box-b").unwrap();
    assert_no_box_leftovers(&t);
}

#[test]
fn overlapping_subnet_is_refused() {
    if !root() {
        return;
    }
    let first = TestNet::with(11, "10.231.11.0/24", |_| {});
    let ns = new_ns();
    let a = first.net().allocate("box-a", &[]).unwrap();
    first
        .net()
        .attach(&a, ns.as_fd(), &AttachOptions::default())
        .unwrap();
    let second = TestNet::with(12, "10.231.11.128/25", |_| {});
    let b = second.net().allocate("box-b", &[]).unwrap();
    let ns2 = new_ns();
    let err = second
        .net()
        .attach(&b, ns2.as_fd(), &AttachOptions::default())
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "box box-b: subnet 10.231.11.128/25 overlaps host route 10.231.11.0/24 (dev {}): choose another subnet",
            first.bridge
        )
    );
    let mut nl = Netlink::open().unwrap();
    assert_eq!(link::index(&mut nl, &second.bridge).unwrap(), None);
    assert_eq!(
        link::index(&mut nl, &second.net().config().ifb()).unwrap(),
        None
    );
}

#[test]
fn exhausted_pool_is_refused() {
    if !root() {
        return;
    }
    let t = TestNet::with(13, "10.231.13.0/30", |_| {});
    let net = t.net();
    net.allocate("box-a", &[]).unwrap();
    let err = net.allocate("box-b", &[]).unwrap_err();
    assert!(matches!(err, NetError::PoolExhausted { .. }));
    assert_eq!(
        err.to_string(),
        "address pool 10.231.13.0/30 of network t13 is exhausted (1 addresses in use)"
    );
    net.detach("box-a").unwrap();
    net.allocate("box-b", &[]).unwrap();
}

#[test]
fn a_full_bridge_is_refused_in_one_line_and_nothing_is_left() {
    if !root() {
        return;
    }
    let t = TestNet::with(18, "10.231.18.0/24", |_| {});
    let net = t.net();
    let a = net.allocate("box-a", &[]).unwrap();
    let ns = new_ns();
    net.attach(&a, ns.as_fd(), &AttachOptions::default())
        .unwrap();
    // The bridge's other ports, up to what the kernel allows: veth pairs
    // whose other ends are in a namespace of their own (gone with it).
    let mut nl = Netlink::open().unwrap();
    let bridge_index = link::index(&mut nl, &t.bridge).unwrap().unwrap();
    let filler = new_ns();
    for i in 1..link::BRIDGE_MAX_PORTS {
        link::create_veth(
            &mut nl,
            &format!("nbt18f{i}"),
            Some(bridge_index),
            &format!("f{i}"),
            filler.as_fd(),
            None,
        )
        .unwrap();
    }
    let b = net.allocate("box-b", &[]).unwrap();
    let ns_b = new_ns();
    let err = net
        .attach(&b, ns_b.as_fd(), &AttachOptions::default())
        .unwrap_err();
    // The filler ports go with their namespace.
    drop(filler);
    let freed = Instant::now();
    while link::index(&mut nl, "nbt18f1").unwrap().is_some() {
        assert!(
            freed.elapsed() < Duration::from_secs(60),
            "filler ports left"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(err.kind(), NetErrorKind::Conflict);
    assert_eq!(
        err.to_string(),
        format!(
            "box box-b: network t18 is full: its bridge {} has 1023 ports, the most a Linux bridge takes; put more boxes on another network (nestbox network create)",
            t.bridge
        )
    );
    // Nothing of box-b's attachment is left: no host veth, no port on the
    // bridge but box-a's, and it can be attached once a port is free.
    let veth_b = nestbox_net::network::host_veth_name(&t.bridge, "box-b");
    assert_eq!(
        link::index(&mut nl, &veth_b).unwrap(),
        None,
        "{veth_b} left"
    );
    let ports = bridge_ports(&mut nl, bridge_index);
    assert_eq!(ports.len(), 1, "only box-a's port: {ports:?}");
    net.attach(&b, ns_b.as_fd(), &AttachOptions::default())
        .unwrap();
    net.detach("box-b").unwrap();
    net.detach("box-a").unwrap();
    assert_no_box_leftovers(&t);
}

#[test]
fn invalid_rates_and_options_are_refused_before_anything_exists() {
    if !root() {
        return;
    }
    let err = parse_rate("10 parsecs").unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid rate \"10 parsecs\": expected a number and a unit such as 100mbit, 1gbit, 10mbps"
    );
    let t = TestNet::with(14, "10.231.14.0/24", |c| {
        c.link_rate = parse_rate("1gbit").unwrap()
    });
    let net = t.net();
    let ns = new_ns();
    let a = net.allocate("box-a", &[]).unwrap();
    let cases = [
        (
            AttachOptions {
                rate: Some(parse_rate("10mbit").unwrap()),
                reserve: Some(parse_rate("20mbit").unwrap()),
                ..Default::default()
            },
            "box box-a: network reservation 20mbit exceeds the network rate cap 10mbit",
        ),
        (
            AttachOptions {
                reserve: Some(parse_rate("2gbit").unwrap()),
                ..Default::default()
            },
            "box box-a: network reservation 2gbit does not fit: link rate 1gbit, 0bit already reserved by other boxes",
        ),
        (
            AttachOptions {
                share: Some(0),
                ..Default::default()
            },
            "box box-a: invalid network share 0: expected 1-1000",
        ),
    ];
    for (opts, msg) in cases {
        let err = net.attach(&a, ns.as_fd(), &opts).unwrap_err();
        assert_eq!(err.to_string(), msg);
    }
    // Refused before the network itself was created.
    let mut nl = Netlink::open().unwrap();
    assert_eq!(link::index(&mut nl, &t.bridge).unwrap(), None);
    assert!(!links_in(ns.as_fd()).contains(&"eth0".to_string()));
    // Bad names and ids.
    assert!(net.allocate("a b", &[]).is_err());
    assert_eq!(
        net.allocate("box-x", &["no spaces"])
            .unwrap_err()
            .to_string(),
        "box box-x: invalid host name \"no spaces\""
    );
}

#[test]
fn attach_latency_is_reported() {
    if !root() {
        return;
    }
    let t = TestNet::new(15);
    let net = t.net();
    // Warm up: the first attach creates the bridge, IFB and table.
    let ns = new_ns();
    let l = net.allocate("warm", &[]).unwrap();
    net.attach(&l, ns.as_fd(), &AttachOptions::default())
        .unwrap();
    let mut times = Vec::new();
    for i in 0..20 {
        let ns = new_ns();
        let lease = net.allocate(&format!("b{i}"), &["x"]).unwrap();
        let t0 = Instant::now();
        net.attach(&lease, ns.as_fd(), &AttachOptions::default())
            .unwrap();
        times.push(t0.elapsed());
        net.detach(&lease.box_id).unwrap();
    }
    times.sort();
    eprintln!(
        "attach latency: median {:?} (min {:?})",
        times[10], times[0]
    );
    assert!(times[10] < Duration::from_millis(200));
}

/// `destroy` racing a box's allocate and attach (a `network rm` while a box
/// starts): whatever the order, nothing of the network is left on the host
/// without the state that owns it (its configuration), so a later removal
/// finds it. Before the fix, an attach that waited for the lock during
/// `destroy` made the bridge, IFB and NAT table again after the state
/// directory was gone.
#[test]
fn destroy_racing_an_attach_leaves_nothing_unowned() {
    if !root() {
        return;
    }
    let t = TestNet::new(17);
    let cfg = t.net().config().clone();
    let mut nl = Netlink::open().unwrap();
    for i in 0..40u64 {
        let net = Network::open(cfg.clone()).unwrap();
        // Made before the race (as the runtime leases before it attaches) on
        // even rounds, in the race on odd ones.
        let early = (i % 2 == 0).then(|| net.allocate("box-a", &[]).unwrap());
        let ns = new_ns();
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        let destroyer = {
            let (cfg, barrier) = (cfg.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                std::thread::sleep(Duration::from_micros((i * 397) % 3000));
                Network::view(cfg).destroy()
            })
        };
        barrier.wait();
        let attached = early
            .map(Ok)
            .unwrap_or_else(|| net.allocate("box-a", &[]))
            .and_then(|lease| net.attach(&lease, ns.as_fd(), &AttachOptions::default()));
        destroyer.join().unwrap().unwrap();
        let owned = NetworkConfig::load(&cfg.state_dir).unwrap().is_some();
        let bridge = link::index(&mut nl, &cfg.bridge).unwrap().is_some();
        let ifb = link::index(&mut nl, &cfg.ifb()).unwrap().is_some();
        let table = nft::list_table(&cfg.bridge).unwrap().is_some()
            || nft::list_guard_table(&cfg.bridge).unwrap().is_some();
        assert!(
            owned || !(bridge || ifb || table),
            "round {i}: bridge {bridge}, IFB {ifb}, table {table} left with no state (attach: {attached:?})"
        );
        if let Err(e) = &attached {
            assert!(
                matches!(e.kind(), NetErrorKind::NotFound),
                "round {i}: attach failed with {e}"
            );
        }
        Network::view(cfg.clone()).destroy().unwrap();
    }
}

#[test]
fn boxes_of_different_networks_reach_each_other_only_through_published_ports() {
    if !root() {
        return;
    }
    // Two networks: the host routes between their bridges, but a connection
    // routed into a bridge from elsewhere is dropped unless it is DNATed (a
    // published port).
    let (t1, t2) = (TestNet::new(28), TestNet::new(29));
    let (ns_a, ns_b) = (new_ns(), new_ns());
    let a = t1.net().allocate("box-a", &[]).unwrap();
    t1.net()
        .attach(&a, ns_a.as_fd(), &AttachOptions::default())
        .unwrap();
    let b = t2.net().allocate("box-b", &[]).unwrap();
    let host_port = nestbox_testkit::unused_port(21500, 500);
    let opts = AttachOptions {
        publish: vec![PortMapping::parse(&format!("{host_port}:7200/tcp")).unwrap()],
        ..Default::default()
    };
    t2.net().attach(&b, ns_b.as_fd(), &opts).unwrap();
    let l = listen(Some(ns_b.as_fd()), Ipv4Addr::UNSPECIFIED, 7200);
    let direct = connect(Some(ns_a.as_fd()), sa(b.address, 7200));
    assert!(
        direct.is_err(),
        "box-a reached box-b of another network: {direct:?}"
    );
    // The published port, on the other network's gateway, is reachable.
    let srv = echo_peer_once(l);
    let seen = ask(Some(ns_a.as_fd()), sa(b.gateway, host_port));
    assert!(
        !seen.is_empty(),
        "box-a did not reach box-b's published port"
    );
    srv.join().unwrap();
    // In the other direction too: box-b cannot reach box-a.
    let _l = listen(Some(ns_a.as_fd()), Ipv4Addr::UNSPECIFIED, 7201);
    let direct = connect(Some(ns_b.as_fd()), sa(a.address, 7201));
    assert!(
        direct.is_err(),
        "box-b reached box-a of another network: {direct:?}"
    );
    t1.net().detach("box-a").unwrap();
    t2.net().detach("box-b").unwrap();
    assert_no_box_leftovers(&t1);
    assert_no_box_leftovers(&t2);
}

#[test]
fn on_an_isolated_network_boxes_reach_only_the_gateway_and_published_ports() {
    if !root() {
        return;
    }
    let t = TestNet::with(30, "10.231.30.0/24", |c| c.isolated = true);
    let net = t.net();
    let (ns_a, ns_b, ns_c) = (new_ns(), new_ns(), new_ns());
    let host_port = nestbox_testkit::unused_port(22000, 500);
    let a = net.allocate("box-a", &[]).unwrap();
    net.attach(
        &a,
        ns_a.as_fd(),
        &AttachOptions {
            allow_host: vec![HostPort::parse("7302").unwrap()],
            ..Default::default()
        },
    )
    .unwrap();
    let b = net.allocate("box-b", &[]).unwrap();
    let publish = AttachOptions {
        publish: vec![PortMapping::parse(&format!("{host_port}:7300/tcp")).unwrap()],
        ..Default::default()
    };
    net.attach(&b, ns_b.as_fd(), &publish).unwrap();
    // A capped box: its traffic takes the egress tree and the bridge.
    let c = net.allocate("box-c", &[]).unwrap();
    let capped = AttachOptions {
        rate: Some(parse_rate("1gbit").unwrap()),
        ..Default::default()
    };
    net.attach(&c, ns_c.as_fd(), &capped).unwrap();

    let l = listen(Some(ns_b.as_fd()), Ipv4Addr::UNSPECIFIED, 7300);
    for (from, name) in [(&ns_a, "box-a"), (&ns_c, "box-c")] {
        let direct = connect(Some(from.as_fd()), sa(b.address, 7300));
        assert!(direct.is_err(), "{name} reached box-b directly: {direct:?}");
    }
    // Box-b's published port, through the gateway, is reachable; the host
    // reaches box-b; box-a reaches the host port it was allowed.
    let srv = echo_peer_once(l);
    assert!(!ask(Some(ns_a.as_fd()), sa(b.gateway, host_port)).is_empty());
    srv.join().unwrap();
    let l = listen(Some(ns_b.as_fd()), Ipv4Addr::UNSPECIFIED, 7301);
    let srv = echo_peer_once(l);
    assert_eq!(ask(None, sa(b.address, 7301)), b.gateway.to_string());
    srv.join().unwrap();
    let l = listen(None, a.gateway, 7302);
    let srv = echo_peer_once(l);
    assert_eq!(
        ask(Some(ns_a.as_fd()), sa(a.gateway, 7302)),
        a.address.to_string()
    );
    srv.join().unwrap();
    // The policy cannot change while boxes are on the network.
    let mut open = net.config().clone();
    open.isolated = false;
    let err = Network::open(open).unwrap_err();
    assert!(err.to_string().contains("policy cannot change"), "{err}");
    for id in ["box-a", "box-b", "box-c"] {
        net.detach(id).unwrap();
    }
    assert_no_box_leftovers(&t);
}

#[test]
fn egress_policies_admit_only_what_they_list_and_log_their_decisions() {
    if !root() {
        return;
    }
    let t = TestNet::new(31);
    let net = t.net();
    // A fake "internet": a namespace reached through the host on another subnet.
    let out = Outside::new(31);
    let (outside, far) = (&out.ns, out.far);

    let tag = std::process::id();
    let attach = |id: &str, egress: &str| {
        let ns = new_ns();
        let lease = net.allocate(id, &[]).unwrap();
        let opts = AttachOptions {
            egress: Egress::parse(egress).unwrap(),
            ..Default::default()
        };
        net.attach(&lease, ns.as_fd(), &opts).unwrap();
        ns
    };
    let listed = format!("listed-{tag}");
    let denied = format!("denied-{tag}");
    let ns_listed = attach(&listed, &format!("{far}:9000,192.0.2.0/24"));
    let ns_denied = attach(&denied, "deny-all");
    let ns_open = attach("open", "allow-all");
    let reach = |ns: &std::os::fd::OwnedFd, port: u16| {
        let l = listen(Some(outside.as_fd()), far, port);
        let srv = echo_peer_once(l);
        let ok = connect(Some(ns.as_fd()), sa(far, port)).is_ok();
        if !ok {
            // Unblock the accept.
            let _ = connect(None, sa(far, port));
        }
        srv.join().unwrap();
        ok
    };
    assert!(reach(&ns_listed, 9000), "the listed port was refused");
    assert!(!reach(&ns_listed, 9001), "a port not listed was admitted");
    assert!(!reach(&ns_denied, 9000), "deny-all admitted a connection");
    assert!(reach(&ns_open, 9001), "allow-all refused a connection");
    // Decisions are in the kernel log, with the box's id.
    let log =
        String::from_utf8_lossy(&std::process::Command::new("dmesg").output().unwrap().stdout)
            .to_string();
    for line in [
        format!("nestbox-egress allow box={listed} "),
        format!("nestbox-egress deny box={listed} "),
        format!("nestbox-egress deny box={denied} "),
    ] {
        assert!(log.contains(&line), "no {line:?} in the kernel log");
    }
    // `inspect` shows the policy; removal leaves no chain of the boxes.
    let atts = net.attachments().unwrap();
    let l = atts.iter().find(|a| a.lease.box_id == listed).unwrap();
    assert_eq!(l.egress.to_string(), format!("{far}/32:9000,192.0.2.0/24"));
    let table = nft::list_guard_table(&t.bridge).unwrap().unwrap();
    assert!(table.contains("chain egress_"), "{table}");
    for id in [listed.as_str(), denied.as_str(), "open"] {
        net.detach(id).unwrap();
    }
    let table = nft::list_guard_table(&t.bridge).unwrap().unwrap();
    assert!(!table.contains("egress_"), "egress chains left:\n{table}");
    assert_no_box_leftovers(&t);
}

#[test]
fn a_preferred_address_is_given_back_when_free_and_only_then() {
    if !root() {
        return;
    }
    // A box started again asks for the address it had (a rollback that puts
    // its processes back keeps the address their peers know).
    let t = TestNet::new(32);
    let net = t.net();
    let a = net.allocate("box-a", &[]).unwrap();
    let b = net.allocate("box-b", &[]).unwrap();
    net.detach("box-a").unwrap();
    let again = net
        .allocate_preferring("box-a", &[], Some(a.address))
        .unwrap();
    assert_eq!(again.address, a.address);
    // Taken by another box, or outside the subnet: the next free address.
    let c = net
        .allocate_preferring("box-c", &[], Some(b.address))
        .unwrap();
    let d = net
        .allocate_preferring("box-d", &[], Some(Ipv4Addr::new(192, 0, 2, 7)))
        .unwrap();
    let gateway = net.config().subnet.gateway();
    let e = net
        .allocate_preferring("box-e", &[], Some(gateway))
        .unwrap();
    let all: BTreeSet<Ipv4Addr> = [again.address, b.address, c.address, d.address, e.address]
        .into_iter()
        .collect();
    assert_eq!(all.len(), 5, "addresses given twice: {all:?}");
    assert!(!all.contains(&gateway));
    for id in ["box-a", "box-b", "box-c", "box-d", "box-e"] {
        net.detach(id).unwrap();
    }
    assert_no_box_leftovers(&t);
}
