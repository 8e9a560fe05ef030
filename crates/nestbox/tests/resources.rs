//! Resource limits and accounting: the memory limit OOM-kills only the box, the
//! pids limit stops a fork bomb, limits reach the box cgroups, stats are plausible,
//! --io-weight fails clearly where the kernel cannot do it, runs without root, and
//! (timing-sensitive, `serial_`) the CPU cap and CPU shares hold.

mod common;

use std::time::Duration;

use common::*;

const START: Duration = Duration::from_secs(20);
const NOBODY: u32 = 65534;

#[test]
fn memory_limit_oom_kills_only_the_box() {
    let Some(root) = TestRoot::new("memory_limit_oom_kills_only_the_box") else {
        return;
    };
    root.detached_sh("res-neighbour", &[], "echo ready; sleep 60");
    root.wait_log("res-neighbour", "ready", START);
    let out = root.py(
        &["--name", "res-oom", "--memory", "32m"],
        "b = b'x' * (200 << 20)\nprint('allocated')",
    );
    assert_eq!(
        out.code, 137,
        "the box must be killed (SIGKILL) by the OOM killer\n{out}"
    );
    assert!(!out.stdout.contains("allocated"), "{out}");
    assert!(
        out.stderr.contains("OOM"),
        "stderr must report the OOM kill\n{out}"
    );
    let v = root.inspect("res-oom");
    assert_eq!(v["oom_killed"], true, "{v}");
    assert_eq!(v["state"]["oom_killed"], true, "{v}");
    assert_eq!(v["exit_code"], 137, "{v}");
    // Only the box: its neighbour still runs, and new boxes start fine.
    assert_eq!(root.status("res-neighbour").as_deref(), Some("running"));
    assert_eq!(root.sh(&[], "echo fine").ok().stdout, "fine\n");
}

#[test]
fn fork_bomb_is_stopped_by_the_pids_limit() {
    let Some(root) = TestRoot::new("fork_bomb_is_stopped_by_the_pids_limit") else {
        return;
    };
    // Fork until the kernel refuses, report, hold the children until SIGUSR1, then
    // release them and show the box can fork again.
    let code = "import os, signal, time
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
kids, err = [], None
for _ in range(500):
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    kids.append(pid)
print('forks', len(kids), 'errno', err, flush=True)
signal.sigwait([signal.SIGUSR1])
for k in kids:
    os.kill(k, signal.SIGKILL)
for k in kids:
    os.waitpid(k, 0)
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
print('recovered', flush=True)
";
    root.run(&[
        "run",
        "-d",
        "--name",
        "res-forkbomb",
        "--pids",
        "20",
        "--",
        "python3",
        "-c",
        code,
    ])
    .ok();
    let log = root.wait_log("res-forkbomb", "forks", Duration::from_secs(30));
    let f: Vec<&str> = log.split_whitespace().collect();
    let (forks, errno): (u32, &str) = (f[1].parse().unwrap(), f[3]);
    assert_eq!(
        errno, "11",
        "fork must fail with EAGAIN at the limit\nlog: {log:?}"
    );
    assert!(
        (10..=18).contains(&forks),
        "init + python + {forks} children does not fit a limit of 20\nlog: {log:?}"
    );
    let stats = root.stats("res-forkbomb");
    assert!(stats["pids_current"].as_u64().unwrap() <= 20, "{stats}");
    let v = root.inspect("res-forkbomb");
    let current = cgroup_file(&v, "pids.current").expect("pids.current");
    assert!(read_trimmed(&current).parse::<u64>().unwrap() <= 20);
    assert_eq!(read_trimmed(&cgroup_file(&v, "pids.max").unwrap()), "20");
    root.run(&["kill", "-s", "USR1", "res-forkbomb"]).ok();
    assert_eq!(
        root.wait_exited("res-forkbomb", START),
        0,
        "the box survives its fork bomb"
    );
    assert!(root.ok(&["logs", "res-forkbomb"]).contains("recovered"));
}

#[test]
fn limits_are_written_to_the_box_cgroups() {
    let Some(root) = TestRoot::new("limits_are_written_to_the_box_cgroups") else {
        return;
    };
    let opts = [
        "--memory",
        "64m",
        "--pids",
        "50",
        "--cpus",
        "0.5",
        "--cpu-shares",
        "512",
        "--cpuset-cpus",
        "0",
    ];
    root.detached_sh("res-limits", &opts, "sleep 60");
    let v = root.inspect("res-limits");
    let file = |names: &[&str]| {
        names
            .iter()
            .find_map(|n| cgroup_file(&v, n))
            .unwrap_or_else(|| panic!("no {names:?} in the box cgroups: {v}"))
    };
    assert_eq!(
        read_trimmed(&file(&["memory.limit_in_bytes", "memory.max"])),
        (64u64 << 20).to_string()
    );
    assert_eq!(read_trimmed(&file(&["pids.max"])), "50");
    let quota: f64 = read_trimmed(&file(&["cpu.cfs_quota_us"])).parse().unwrap();
    let period: f64 = read_trimmed(&file(&["cpu.cfs_period_us"])).parse().unwrap();
    assert!(
        (quota / period - 0.5).abs() < 1e-6,
        "quota {quota} / period {period} is not 0.5"
    );
    assert_eq!(read_trimmed(&file(&["cpu.shares"])), "512");
    assert_eq!(read_trimmed(&file(&["cpuset.cpus"])), "0");
    let limits = &v["limits"];
    assert_eq!(limits["pids"], 50, "{v}");
    assert_eq!(limits["cpus"], 0.5, "{v}");
}

#[test]
fn stats_of_a_running_box_are_plausible() {
    let Some(root) = TestRoot::new("stats_of_a_running_box_are_plausible") else {
        return;
    };
    root.detached_sh("res-stats", &[], "echo ready; sleep 60");
    root.wait_log("res-stats", "ready", START);
    let s = root.stats("res-stats");
    let n = |k: &str| {
        s[k].as_u64()
            .unwrap_or_else(|| panic!("stats has no number {k}: {s}"))
    };
    assert!(n("memory_current") > 0, "{s}");
    assert!(n("memory_peak") >= n("memory_current"), "{s}");
    assert!(n("pids_current") >= 2, "init and the command at least: {s}");
    assert!(n("cpu_usage_ns") > 0, "{s}");
    assert_eq!(n("oom_kills"), 0, "{s}");
    let table = root.ok(&["stats", "res-stats"]);
    assert!(
        table.lines().any(|l| l.starts_with("res-stats")),
        "stats table:\n{table}"
    );
}

#[test]
fn io_weight_is_applied_or_refused_clearly() {
    let Some(root) = TestRoot::new("io_weight_is_applied_or_refused_clearly") else {
        return;
    };
    // Whether the kernel offers a weight file shows only in a child cgroup (BFQ's
    // blkio.bfq.weight exists below the root only), so either outcome is allowed:
    // the weight is in the box cgroup, or one clear error and nothing left behind.
    let out = root.run(&[
        "run",
        "-d",
        "--name",
        "res-io",
        "--io-weight",
        "500",
        "--",
        "sleep",
        "60",
    ]);
    if out.code != 0 {
        assert_error(&out, 125, "weight");
        root.assert_no_boxes();
        return;
    }
    let v = root.inspect("res-io");
    let file = [
        "blkio.weight",
        "blkio.bfq.weight",
        "io.weight",
        "io.bfq.weight",
    ]
    .iter()
    .find_map(|f| cgroup_file(&v, f))
    .unwrap_or_else(|| panic!("--io-weight accepted but the box cgroups have no weight file: {v}"));
    let text = read_trimmed(&file);
    assert!(
        text.split_whitespace().any(|w| w == "500"),
        "{} holds {text:?}, not the weight 500",
        file.display()
    );
}

#[test]
fn run_without_root_uses_a_user_namespace() {
    let Some(root) = TestRoot::as_user("run_without_root_uses_a_user_namespace", NOBODY, NOBODY)
    else {
        return;
    };
    let out = root.sh(&[], "echo $$; id -u").ok();
    assert_eq!(
        out.lines(),
        ["2", "0"],
        "pid 2 and root, in the box's own namespaces\n{out}"
    );
}

#[test]
fn memory_limit_without_root_fails_clearly() {
    let Some(root) = TestRoot::as_user("memory_limit_without_root_fails_clearly", NOBODY, NOBODY)
    else {
        return;
    };
    let out = root.run(&["run", "--memory", "64m", "--", "true"]);
    assert_error(&out, 125, "cgroup");
    root.assert_no_boxes();
}

#[test]
fn serial_cpus_half_caps_busy_loop() {
    let Some(root) = TestRoot::new("serial_cpus_half_caps_busy_loop") else {
        return;
    };
    let code = "import time
t0 = time.monotonic(); c0 = time.process_time()
while time.monotonic() - t0 < 3:
    pass
print((time.process_time() - c0) / (time.monotonic() - t0))
";
    let out = root.py(&["--cpus", "0.5"], code).ok();
    let ratio: f64 = out
        .stdout
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{out}"));
    eprintln!("serial_cpus_half_caps_busy_loop: {ratio:.3} CPU per wall second");
    assert!(
        (0.45..=0.55).contains(&ratio),
        "--cpus 0.5 gave {ratio:.3} CPU per wall second"
    );
}

#[test]
fn serial_cpu_shares_2_to_1() {
    let Some(root) = TestRoot::new("serial_cpu_shares_2_to_1") else {
        return;
    };
    for (name, shares) in [("res-shares-hi", "2048"), ("res-shares-lo", "1024")] {
        let args = [
            "run",
            "-d",
            "--name",
            name,
            "--cpuset-cpus",
            "0",
            "--cpu-shares",
            shares,
            "--",
            "python3",
            "-c",
            "while True: pass",
        ];
        root.run(&args).ok();
    }
    let cpu = |name: &str| root.stats(name)["cpu_usage_ns"].as_u64().unwrap() as f64;
    std::thread::sleep(Duration::from_secs(1)); // both busy and competing
    let (hi0, lo0) = (cpu("res-shares-hi"), cpu("res-shares-lo"));
    std::thread::sleep(Duration::from_secs(4));
    let (hi1, lo1) = (cpu("res-shares-hi"), cpu("res-shares-lo"));
    let ratio = (hi1 - hi0) / (lo1 - lo0);
    eprintln!("serial_cpu_shares_2_to_1: CPU-time ratio {ratio:.3}");
    assert!(
        (1.8..=2.2).contains(&ratio),
        "shares 2048:1024 on one CPU gave a CPU-time ratio of {ratio:.3}"
    );
}

/// Loop devices whose backing file is under `dir`.
fn loops_backed_under(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let backing = e.path().join("loop/backing_file");
        if let Ok(f) = std::fs::read_to_string(&backing) {
            if f.trim().starts_with(&*dir.to_string_lossy()) {
                out.push(format!(
                    "{} -> {}",
                    e.file_name().to_string_lossy(),
                    f.trim()
                ));
            }
        }
    }
    out
}

/// Mount points (host mount namespace) under `dir`.
fn mounts_under(dir: &std::path::Path) -> Vec<String> {
    let dir = dir.to_string_lossy().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .filter(|m| m.starts_with(&dir))
        .collect()
}

/// Files named `disk.img` under `dir`.
fn disk_images_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(t) = e.file_type() else { continue };
            if t.is_dir() && !t.is_symlink() {
                stack.push(e.path());
            } else if e.file_name() == "disk.img" {
                out.push(e.path());
            }
        }
    }
    out
}

#[track_caller]
fn assert_no_disk_left(root: &TestRoot) {
    assert_eq!(loops_backed_under(root.path()), Vec::<String>::new());
    assert_eq!(mounts_under(root.path()), Vec::<String>::new());
    assert_eq!(
        disk_images_under(root.path()),
        Vec::<std::path::PathBuf>::new()
    );
}

#[test]
fn disk_quota_fails_writes_past_it_with_enospc_in_the_box_only() {
    let Some(root) = TestRoot::new("disk_quota_fails_writes_past_it_with_enospc_in_the_box_only")
    else {
        return;
    };
    // Write MiB by MiB until the kernel refuses; report the errno by name.
    let fill = "import errno, os, time
n = 0
try:
    with open('/fill', 'wb') as f:
        while n < 200:
            f.write(b'x' * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
            n += 1
    print('wrote', n, flush=True)
except OSError as e:
    print('errno', errno.errorcode[e.errno], 'after', n, flush=True)
time.sleep(60)
";
    root.run(&[
        "run",
        "-d",
        "--name",
        "disk-full",
        "--network",
        "none",
        "--disk",
        "16m",
        "--",
        "python3",
        "-c",
        fill,
    ])
    .ok();
    let log = root.wait_log("disk-full", "after", START);
    let after: u64 = log
        .lines()
        .find(|l| l.contains("after"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        log.contains("errno ENOSPC after"),
        "the box must get ENOSPC: {log}"
    );
    assert!(
        (8..=16).contains(&after),
        "a 16m layer holds 8..16 MiB of data, the box wrote {after} MiB"
    );
    // Usage: used near the limit, limit at most the size asked.
    let s: serde_json::Value =
        serde_json::from_str(&root.ok(&["stats", "--json", "disk-full"])).unwrap();
    let used = s["disk"]["used_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("{s}"));
    let limit = s["disk"]["limit_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("{s}"));
    assert!((12 << 20..=16 << 20).contains(&limit), "{s}");
    assert!(used >= after << 20 && used <= limit, "{s}");
    assert!(root.ok(&["stats", "disk-full"]).contains("disk: "));
    // The other boxes and the host are not limited by it: a box without --disk
    // and a box with a disk of its own write more than the full box could.
    for opts in [
        &["--rm", "--network", "none"][..],
        &["--rm", "--network", "none", "--disk", "64m"][..],
    ] {
        let out = root.py(
            opts,
            "open('/big', 'wb').write(b'y' * (32 << 20)); print('ok')",
        );
        assert_eq!(out.ok().stdout, "ok\n");
    }
    let host_file = root.path().join("host-file");
    std::fs::write(&host_file, vec![7u8; 32 << 20]).expect("the host writes");
    std::fs::remove_file(&host_file).unwrap();
    root.rm_all(["disk-full"]);
    assert_no_disk_left(&root);

    // A box whose monitor and init die by SIGKILL: gc releases its disk.
    root.detached_sh(
        "disk-killed",
        &["--network", "none", "--disk", "16m"],
        "echo ready; sleep 60",
    );
    root.wait_log("disk-killed", "ready", START);
    assert_eq!(mounts_under(root.path()).len(), 1);
    let v = root.inspect("disk-killed");
    for key in ["monitor_pid", "init_pid"] {
        let pid = v["state"][key].as_i64().expect(key) as i32;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL).unwrap();
    }
    wait_for("the box to be dead", START, || {
        root.status("disk-killed").as_deref() != Some("running")
    });
    root.ok(&["gc"]);
    assert_eq!(root.status("disk-killed"), None);
    assert_no_disk_left(&root);

    // Bad sizes fail clearly and leave nothing.
    let out = root.run(&["run", "--disk", "1m", "--", "true"]);
    assert_error(&out, 125, "--disk 1048576 bytes is out of range");
    let out = root.run(&["run", "--disk", "lots", "--", "true"]);
    assert_error(&out, 125, "--disk: invalid size");
    assert_no_disk_left(&root);
}

#[test]
fn serial_cpu_reserve_holds_next_to_four_busy_boxes_with_larger_shares() {
    let Some(root) =
        TestRoot::new("serial_cpu_reserve_holds_next_to_four_busy_boxes_with_larger_shares")
    else {
        return;
    };
    let busy = "while True: pass";
    root.run(&[
        "run",
        "-d",
        "--name",
        "res-reserved",
        "--network",
        "none",
        "--cpu-reserve",
        "0.5",
        "--",
        "python3",
        "-c",
        busy,
    ])
    .ok();
    // Four boxes, each with four times the default shares and two busy
    // processes: together they could take both CPUs many times over.
    let two_busy = format!("python3 -c '{busy}' & python3 -c '{busy}'; wait");
    for i in 0..4 {
        let name = format!("res-hog-{i}");
        root.detached_sh(
            &name,
            &["--network", "none", "--cpu-shares", "4096"],
            &two_busy,
        );
    }
    let cpu = |name: &str| root.stats(name)["cpu_usage_ns"].as_u64().unwrap() as f64;
    std::thread::sleep(Duration::from_secs(1)); // all busy and competing
    let (r0, h0) = (cpu("res-reserved"), cpu("res-hog-0"));
    let t0 = std::time::Instant::now();
    std::thread::sleep(Duration::from_secs(4));
    let (r1, h1) = (cpu("res-reserved"), cpu("res-hog-0"));
    let wall = t0.elapsed().as_secs_f64();
    let reserved = (r1 - r0) / 1e9 / wall;
    let hog = (h1 - h0) / 1e9 / wall;
    eprintln!(
        "serial_cpu_reserve: reserved box {reserved:.3} CPU, one hog {hog:.3} CPU (load {})",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    assert!(
        reserved >= 0.9 * 0.5,
        "a box reserving 0.5 CPU got {reserved:.3} CPU next to four busy boxes with 4x its shares"
    );
    // Reservations beyond 90% of the CPUs are refused, clearly.
    let cpus = std::thread::available_parallelism().unwrap().get() as f64;
    let out = root.run(&[
        "run",
        "--network",
        "none",
        "--cpu-reserve",
        &format!("{}", 0.9 * cpus - 0.25),
        "--",
        "true",
    ]);
    assert_error(&out, 125, "already reserve 0.5 of");
    let out = root.run(&["run", "--cpu-reserve", "0", "--", "true"]);
    assert_error(&out, 125, "cgroup: invalid cpu_reserve=0: must be > 0");
    let out = root.run(&["run", "--cpus", "0.2", "--cpu-reserve", "0.5", "--", "true"]);
    assert_error(&out, 125, "must be <= cpus (0.2)");
}
