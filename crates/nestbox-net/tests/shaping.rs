//! Bandwidth control measured: shares divide a saturated link 2:1, a
//! reservation holds under competition, an egress cap and an ingress cap hold,
//! both also for traffic between boxes, and traffic between uncapped boxes does
//! not leave the network, so the link rate does not limit it. Traffic flows only between namespaces these tests make and the
//! host's end of their bridge, for a few seconds each. They measure rates on a
//! 2-core machine, so they are named `serial_` and run alone, after the rest of
//! the suite (`scripts/test.sh`).

mod common;

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use common::*;
use nestbox_net::{parse_rate, AttachOptions, HostPort, Lease, Network};

const WARMUP: Duration = Duration::from_millis(700);
const WINDOW: Duration = Duration::from_millis(2500);

fn mbit(v: f64) -> f64 {
    v / 1e6
}

/// Ports of the sinks on the host (the gateway): the host is no destination
/// for a box unless it is allowed the port.
const HOST_SINKS: [u16; 2] = [7401, 7402];

/// A sink on the host's end of the bridge (the gateway), on host port `port`.
fn host_sink(lease: &Lease, port: u16) -> Sink {
    Sink::on(None, lease.gateway, port, 1)
}

/// A new namespace attached to `net` as box `id` with `opts`, allowed to reach
/// the host's sinks.
fn attached(net: &Network, id: &str, mut opts: AttachOptions) -> (OwnedFd, Lease) {
    opts.allow_host = HOST_SINKS
        .iter()
        .map(|p| HostPort::parse(&p.to_string()).unwrap())
        .collect();
    let ns = new_ns();
    let lease = net.allocate(id, &[]).unwrap();
    net.attach(&lease, ns.as_fd(), &opts).unwrap();
    (ns, lease)
}

/// Run every flow (sender namespace, `None` for the host; sink) at once and
/// return what each sink received in the measuring window, in bits/s.
fn rates(flows: &[(Option<BorrowedFd<'_>>, &Sink)]) -> Vec<f64> {
    let until = Instant::now() + WARMUP + WINDOW + Duration::from_millis(300);
    let senders: Vec<_> = flows
        .iter()
        .map(|(from, sink)| blast(*from, sink.addr, until))
        .collect();
    let counters: Vec<_> = flows.iter().map(|(_, s)| s.counters[0].clone()).collect();
    let r = measure(&counters, WARMUP, WINDOW);
    for s in senders {
        s.join().unwrap();
    }
    r
}

#[test]
fn serial_shares_divide_a_saturated_link_two_to_one() {
    if !root() {
        return;
    }
    let t = TestNet::with(21, "10.231.21.0/24", |c| {
        c.link_rate = parse_rate("120mbit").unwrap()
    });
    let net = t.net();
    let share = |s| AttachOptions {
        share: Some(s),
        ..Default::default()
    };
    let (ns_a, a) = attached(net, "heavy", share(200));
    let (ns_b, _) = attached(net, "light", share(100));
    let sink_a = host_sink(&a, HOST_SINKS[0]);
    let sink_b = host_sink(&a, HOST_SINKS[1]);
    let r = rates(&[(Some(ns_a.as_fd()), &sink_a), (Some(ns_b.as_fd()), &sink_b)]);
    let ratio = r[0] / r[1];
    eprintln!(
        "shares 200:100 on 120mbit: {:.1} and {:.1} mbit/s, ratio {ratio:.2}",
        mbit(r[0]),
        mbit(r[1])
    );
    assert!((1.8..=2.2).contains(&ratio), "ratio {ratio:.2}");
    let total = mbit(r[0] + r[1]);
    assert!((100.0..=130.0).contains(&total), "total {total:.1} mbit/s");
}

#[test]
fn serial_a_reservation_holds_under_competition() {
    if !root() {
        return;
    }
    let t = TestNet::with(22, "10.231.22.0/24", |c| {
        c.link_rate = parse_rate("100mbit").unwrap()
    });
    let net = t.net();
    let (ns_a, a) = attached(
        net,
        "reserved",
        AttachOptions {
            reserve: Some(parse_rate("60mbit").unwrap()),
            share: Some(1),
            ..Default::default()
        },
    );
    let (ns_b, _) = attached(
        net,
        "greedy",
        AttachOptions {
            share: Some(1000),
            ..Default::default()
        },
    );
    let sink_a = host_sink(&a, HOST_SINKS[0]);
    let sink_b = host_sink(&a, HOST_SINKS[1]);
    let r = rates(&[(Some(ns_a.as_fd()), &sink_a), (Some(ns_b.as_fd()), &sink_b)]);
    eprintln!(
        "reserve 60mbit (share 1) vs share 1000 on 100mbit: {:.1} and {:.1} mbit/s",
        mbit(r[0]),
        mbit(r[1])
    );
    assert!(
        mbit(r[0]) >= 54.0,
        "reserved box got {:.1} mbit/s",
        mbit(r[0])
    );
    assert!(mbit(r[0] + r[1]) <= 110.0);
}

#[test]
fn serial_an_egress_cap_holds() {
    if !root() {
        return;
    }
    let t = TestNet::with(23, "10.231.23.0/24", |c| {
        c.link_rate = parse_rate("1gbit").unwrap()
    });
    let net = t.net();
    let (ns, a) = attached(
        net,
        "capped",
        AttachOptions {
            rate: Some(parse_rate("40mbit").unwrap()),
            ..Default::default()
        },
    );
    let sink = host_sink(&a, HOST_SINKS[0]);
    let r = rates(&[(Some(ns.as_fd()), &sink)]);
    eprintln!("egress cap 40mbit: {:.1} mbit/s", mbit(r[0]));
    assert!(
        (32.0..=44.0).contains(&mbit(r[0])),
        "{:.1} mbit/s",
        mbit(r[0])
    );
}

#[test]
fn serial_an_ingress_cap_holds() {
    if !root() {
        return;
    }
    let t = TestNet::new(24);
    let net = t.net();
    let (ns, a) = attached(
        net,
        "capped-in",
        AttachOptions {
            ingress_rate: Some(parse_rate("30mbit").unwrap()),
            ..Default::default()
        },
    );
    let sink = Sink::new(Some(ns.as_fd()), a.address, 1);
    let r = rates(&[(None, &sink)]);
    eprintln!("ingress cap 30mbit: {:.1} mbit/s", mbit(r[0]));
    assert!(
        (24.0..=33.0).contains(&mbit(r[0])),
        "{:.1} mbit/s",
        mbit(r[0])
    );
}

#[test]
fn serial_an_egress_cap_holds_towards_other_boxes() {
    if !root() {
        return;
    }
    let t = TestNet::with(25, "10.231.25.0/24", |c| {
        c.link_rate = parse_rate("1gbit").unwrap()
    });
    let net = t.net();
    let (ns_a, _) = attached(
        net,
        "capped",
        AttachOptions {
            rate: Some(parse_rate("40mbit").unwrap()),
            ..Default::default()
        },
    );
    let (ns_b, b) = attached(net, "peer", AttachOptions::default());
    let sink = Sink::new(Some(ns_b.as_fd()), b.address, 1);
    let r = rates(&[(Some(ns_a.as_fd()), &sink)]);
    eprintln!("egress cap 40mbit, box to box: {:.1} mbit/s", mbit(r[0]));
    assert!(
        (32.0..=44.0).contains(&mbit(r[0])),
        "{:.1} mbit/s",
        mbit(r[0])
    );
}

#[test]
fn serial_traffic_between_uncapped_boxes_is_not_limited_by_the_link_rate() {
    if !root() {
        return;
    }
    let t = TestNet::with(26, "10.231.26.0/24", |c| {
        c.link_rate = parse_rate("50mbit").unwrap()
    });
    let net = t.net();
    let (ns_a, a) = attached(net, "sender", AttachOptions::default());
    let (ns_b, b) = attached(net, "receiver", AttachOptions::default());
    // To the host the link rate holds...
    let host = host_sink(&a, HOST_SINKS[0]);
    let to_host = rates(&[(Some(ns_a.as_fd()), &host)])[0];
    // ... to another box it does not.
    let peer = Sink::new(Some(ns_b.as_fd()), b.address, 1);
    let to_box = rates(&[(Some(ns_a.as_fd()), &peer)])[0];
    eprintln!(
        "link 50mbit: box to host {:.1} mbit/s, box to box {:.1} mbit/s",
        mbit(to_host),
        mbit(to_box)
    );
    assert!(mbit(to_host) <= 55.0, "to host {:.1} mbit/s", mbit(to_host));
    assert!(mbit(to_box) >= 250.0, "to box {:.1} mbit/s", mbit(to_box));
}

#[test]
fn serial_an_ingress_cap_holds_for_traffic_from_other_boxes() {
    if !root() {
        return;
    }
    let t = TestNet::new(27);
    let net = t.net();
    let (ns_a, _) = attached(net, "sender", AttachOptions::default());
    let (ns_b, b) = attached(
        net,
        "capped-in",
        AttachOptions {
            ingress_rate: Some(parse_rate("30mbit").unwrap()),
            ..Default::default()
        },
    );
    let sink = Sink::new(Some(ns_b.as_fd()), b.address, 1);
    let r = rates(&[(Some(ns_a.as_fd()), &sink)]);
    eprintln!("ingress cap 30mbit, from a box: {:.1} mbit/s", mbit(r[0]));
    assert!(
        (24.0..=33.0).contains(&mbit(r[0])),
        "{:.1} mbit/s",
        mbit(r[0])
    );
}
