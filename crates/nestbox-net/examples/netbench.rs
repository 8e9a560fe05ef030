//! Helper of `bench/net.sh`: drives the library directly (the runtime is not
//! needed to measure networking).
//!
//! ```text
//! netbench latency STATE_DIR BRIDGE SUBNET N      attach latency, JSON on stdout
//! netbench attach STATE_DIR BRIDGE SUBNET ID PID [EGRESS]
//!                                                 attach /proc/PID/ns/net, print the address
//!                                                 (the box may reach iperf3's port 5201 on the host;
//!                                                 EGRESS: its egress policy, as --egress takes it)
//! netbench destroy STATE_DIR BRIDGE SUBNET        remove the network
//! ```
//!
//! `LINK_RATE` in the environment sets the network's link rate.

use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::Instant;

use nestbox_net::{netns, AttachOptions, Network, NetworkConfig, Subnet};

fn open(dir: &str, bridge: &str, subnet: &str) -> nestbox_net::Result<Network> {
    let mut cfg = NetworkConfig::new("bench", bridge, Subnet::parse(subnet)?, PathBuf::from(dir));
    cfg.ip_forward = false;
    if let Ok(r) = std::env::var("LINK_RATE") {
        cfg.link_rate = nestbox_net::parse_rate(&r)?;
    }
    Network::open(cfg)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn run(args: &[String]) -> nestbox_net::Result<()> {
    let usage = || nestbox_net::NetError::Invalid("usage: see the module documentation".into());
    let a = |i: usize| args.get(i).map(String::as_str).ok_or_else(usage);
    match a(0)? {
        "latency" => {
            let net = open(a(1)?, a(2)?, a(3)?)?;
            let n: usize = a(4)?.parse().map_err(|_| usage())?;
            // The first attach creates the bridge, IFB and NAT table.
            let ns = netns::create()?;
            let l = net.allocate("warm", &["warm"])?;
            net.attach(&l, ns.as_fd(), &AttachOptions::default())?;
            let (mut attach, mut total, mut detach) = (Vec::new(), Vec::new(), Vec::new());
            for i in 0..n {
                let ns = netns::create()?;
                let id = format!("b{i}");
                let t0 = Instant::now();
                let lease = net.allocate(&id, &[&id])?;
                let t1 = Instant::now();
                net.attach(&lease, ns.as_fd(), &AttachOptions::default())?;
                let t2 = Instant::now();
                net.detach(&id)?;
                let t3 = Instant::now();
                attach.push((t2 - t1).as_secs_f64() * 1e3);
                total.push((t2 - t0).as_secs_f64() * 1e3);
                detach.push((t3 - t2).as_secs_f64() * 1e3);
            }
            let min = attach.iter().cloned().fold(f64::MAX, f64::min);
            println!(
                "{{\"n\": {n}, \"attach_median_ms\": {:.3}, \"attach_min_ms\": {min:.3}, \"allocate_attach_median_ms\": {:.3}, \"detach_median_ms\": {:.3}}}",
                median(&mut attach),
                median(&mut total),
                median(&mut detach)
            );
            net.destroy()
        }
        "attach" => {
            let net = open(a(1)?, a(2)?, a(3)?)?;
            let id = a(4)?;
            let pid: i32 = a(5)?.parse().map_err(|_| usage())?;
            let ns = netns::of_pid(pid)?;
            let lease = net.allocate(id, &[id])?;
            let egress = match args.get(6) {
                Some(e) => nestbox_net::Egress::parse(e)?,
                None => nestbox_net::Egress::AllowAll,
            };
            let opts = AttachOptions {
                allow_host: vec![nestbox_net::HostPort::parse("5201/tcp")?],
                egress,
                ..AttachOptions::default()
            };
            net.attach(&lease, ns.as_fd(), &opts)?;
            println!("{}", lease.address);
            Ok(())
        }
        "destroy" => open(a(1)?, a(2)?, a(3)?)?.destroy(),
        _ => Err(usage()),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = run(&args) {
        eprintln!("netbench: {e}");
        std::process::exit(1);
    }
}
