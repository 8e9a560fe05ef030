//! The overload watchdog and memory reservations, seen from outside: with the
//! host's available memory below the watchdog's threshold, the box furthest
//! above its `--memory-reserve` is stopped (not the one that uses the most
//! memory within its reservation, nor a small one), the decision is recorded
//! in `inspect` and shown by `ps`, and the other boxes keep running; above the
//! threshold nothing happens. `serial_`: it reads the host's available memory,
//! which other tests change.

mod common;

use std::time::Duration;

use common::*;

/// Hold `MIB` MiB of touched memory, then idle.
const HOLD: &str = r#"
import sys, time
b = bytearray(b'x' * (int(sys.argv[1]) << 20))
print('ready', flush=True)
while True:
    time.sleep(3600)
"#;

fn mem_available() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap()
        * 1024
}

#[test]
fn serial_watchdog_stops_the_box_furthest_above_its_reservation() {
    let Some(root) = TestRoot::new("serial_watchdog_stops_the_box_furthest_above_its_reservation")
    else {
        return;
    };
    let start = |name: &str, mib: &str, extra: &[&str]| {
        let mut args = vec!["run", "-d", "--network", "none", "--name", name];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "python3", "-c", HOLD, mib]);
        root.ok(&args);
    };
    // Uses the most, but within its reservation.
    start("reserved", "300", &["--memory-reserve", "512m"]);
    // Uses less, with no reservation: the one to stop.
    start("hog", "150", &[]);
    // Small, within its reservation.
    start("victim", "10", &["--memory-reserve", "64m"]);
    for n in ["reserved", "hog", "victim"] {
        root.wait_logged(n, "ready", Duration::from_secs(30));
    }
    // The reservation reaches the box's cgroup.
    let v = root.inspect("reserved");
    let mem = v["cgroup"]["memory"].as_str().expect("memory cgroup");
    let soft = std::fs::read_to_string(format!("{mem}/memory.soft_limit_in_bytes"))
        .or_else(|_| std::fs::read_to_string(format!("{mem}/memory.low")))
        .unwrap();
    assert_eq!(soft.trim(), (512u64 << 20).to_string());

    // Plenty of memory: nothing happens.
    let out = root.ok(&["watchdog", "--once", "--min-available", "1m"]);
    assert_eq!(out.trim(), "");
    for n in ["reserved", "hog", "victim"] {
        assert_eq!(root.status(n).as_deref(), Some("running"), "{n}");
    }

    // Below the threshold: the hog goes.
    let threshold = (mem_available() + (256 << 20)).to_string();
    let out = root.ok(&["watchdog", "--once", "--min-available", &threshold]);
    assert!(out.starts_with("stopped hog:"), "{out}");
    wait_for("the hog to end", Duration::from_secs(10), || {
        root.status("hog").as_deref() == Some("exited")
    });
    let v = root.inspect("hog");
    let w = &v["state"]["watchdog"];
    assert!(w["memory_bytes"].as_u64().unwrap() >= 150 << 20, "{v}");
    assert_eq!(w["reserve_bytes"], 0, "{v}");
    assert_eq!(
        w["min_available_bytes"].as_u64().unwrap().to_string(),
        threshold
    );
    let ps = root.ok(&["ps", "-a"]);
    let line = ps.lines().find(|l| l.starts_with("hog ")).unwrap();
    assert!(line.contains("watchdog"), "{ps}");
    for n in ["reserved", "victim"] {
        assert_eq!(root.status(n).as_deref(), Some("running"), "{n}");
        assert!(root.inspect(n)["state"]["watchdog"].is_null());
    }
    root.rm_all(["reserved", "hog", "victim"]);
}

#[test]
fn a_reservation_above_the_memory_limit_is_refused() {
    let Some(root) = TestRoot::new("a_reservation_above_the_memory_limit_is_refused") else {
        return;
    };
    let out = root.run(&[
        "run",
        "--name",
        "r",
        "--memory",
        "64m",
        "--memory-reserve",
        "128m",
        "--",
        "true",
    ]);
    assert_eq!(out.code, 125, "{out}");
    assert!(
        out.stderr
            .contains("invalid memory_reserve=134217728: must be <= memory (67108864)"),
        "{out}"
    );
    assert_eq!(out.stderr.trim().lines().count(), 1, "{out}");
    assert!(
        root.run(&["inspect", "r"]).code != 0,
        "nothing is left of r"
    );
}
