//! Boxes in boxes (`run --nest`, docs/nesting.md): nestbox run, ps, exec and
//! rm three levels deep without host root inside; the parent's memory and
//! pids limits bound its boxes through the cgroup hierarchy; removing,
//! stopping or SIGKILLing any level leaves nothing (processes, cgroups,
//! mounts, veth) once `gc` has run; networking, freeze, clone and pools of
//! clones inside, one and two levels deep.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use serde_json::Value;

const START: Duration = Duration::from_secs(30);

/// The arguments of `nestbox ARGS...` run by the nestbox inside the box at
/// `path` (outermost first): `exec A -- nestbox exec B -- nestbox ARGS...`.
fn inside<'a>(path: &[&'a str], args: &[&'a str]) -> Vec<&'a str> {
    let mut out = Vec::new();
    for (i, b) in path.iter().enumerate() {
        if i > 0 {
            out.push("nestbox");
        }
        out.extend(["exec", b, "--"]);
    }
    if !path.is_empty() {
        out.push("nestbox");
    }
    out.extend_from_slice(args);
    out
}

/// Start `nestbox run -d --name NAME OPTS... -- sleep 1000` inside the box at
/// `path` (the host for an empty path).
#[track_caller]
fn start(root: &TestRoot, path: &[&str], name: &str, opts: &[&str]) {
    let mut args = vec!["run", "-d", "--name", name];
    args.extend_from_slice(opts);
    args.extend(["--", "sleep", "1000"]);
    let out = root.run_timeout(&inside(path, &args), START).ok();
    assert_eq!(out.stdout.trim(), name, "{out}");
}

/// The `ps --tree --json` rows from the host, by name.
fn tree(root: &TestRoot, all: bool) -> Vec<Value> {
    let mut args = vec!["ps", "--tree", "--json"];
    if all {
        args.push("-a");
    }
    let out = root.run(&args).ok();
    match serde_json::from_str(&out.stdout) {
        Ok(Value::Array(rows)) => rows,
        _ => panic!("ps --tree --json printed no array\n{out}"),
    }
}

fn row<'a>(rows: &'a [Value], name: &str) -> Option<&'a Value> {
    rows.iter().find(|r| r["name"] == name)
}

/// The host pid of the init of the box shown as `name` by `ps --tree`.
#[track_caller]
fn host_pid(root: &TestRoot, name: &str) -> i32 {
    let rows = tree(root, false);
    let r = row(&rows, name).unwrap_or_else(|| panic!("no {name} in {rows:?}"));
    r["pid"]
        .as_i64()
        .unwrap_or_else(|| panic!("{name} has no pid: {r}")) as i32
}

/// A /proc/PID/status field of a host process.
fn status_of(pid: i32, key: &str) -> Option<String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status_field(&s, key).map(str::to_string)
}

/// The parent of host process `pid`.
fn parent_of(pid: i32) -> i32 {
    status_of(pid, "PPid")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no parent of {pid}"))
}

/// Every cgroup directory at or below `dirs` (a box's, with the boxes inside it).
fn subtree(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo: Vec<PathBuf> = dirs.iter().filter(|d| d.exists()).cloned().collect();
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push(e.path());
            }
        }
        out.push(d);
    }
    out
}

fn box_dirs(root: &TestRoot, name: &str) -> Vec<PathBuf> {
    cgroup_paths(&root.inspect(name)).into_values().collect()
}

/// Normalise the whitespace of `uid_map` lines.
fn squeeze(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Whether any mount of the host's namespace lies under `dir`.
fn mounts_under(dir: &Path) -> Vec<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let d = dir.to_string_lossy().to_string();
    info.lines()
        .filter(|l| l.split(' ').nth(4).is_some_and(|m| m.starts_with(&d)))
        .map(str::to_string)
        .collect()
}

#[test]
fn three_levels_run_ps_exec_rm_without_host_root() {
    let Some(root) = TestRoot::new("three_levels_run_ps_exec_rm_without_host_root") else {
        return;
    };
    // Level 1 on the host's default (bridge) network, so that its removal
    // has a veth to release too.
    start(&root, &[], "n1", &["--nest"]);
    start(&root, &["n1"], "n2", &["--nest"]);
    start(&root, &["n1", "n2"], "n3", &[]);

    // Each level's root is uid 0 in its box and an unprivileged id outside:
    // box ids map into the upper half of the parent's.
    let maps = [
        (vec!["n1"], "0 1000000000 65536"),
        (vec!["n1", "n2"], "0 32768 32768"),
        (vec!["n1", "n2", "n3"], "0 16384 16384"),
    ];
    for (path, want) in &maps {
        let mut args = inside(
            &path[..path.len() - 1],
            &["exec", path[path.len() - 1], "--"],
        );
        args.extend(["sh", "-c", "cat /proc/self/uid_map; id -u"]);
        let out = root.run(&args).ok();
        let mut lines = out.stdout.lines();
        assert_eq!(
            squeeze(lines.next().unwrap_or("")),
            *want,
            "{path:?}\n{out}"
        );
        assert_eq!(lines.next(), Some("0"), "{path:?}\n{out}");
    }
    // Seen from the host, the level-3 box's root is host uid 1000049152.
    let n3 = host_pid(&root, "n1/n2/n3");
    assert_eq!(
        status_of(n3, "Uid").map(|u| squeeze(&u)).as_deref(),
        Some("1000049152 1000049152 1000049152 1000049152")
    );
    assert_eq!(
        squeeze(&std::fs::read_to_string(format!("/proc/{n3}/uid_map")).unwrap()),
        "0 1000049152 16384"
    );

    // ps inside each level lists that level's boxes by their own names.
    let ps1 = root.run(&inside(&["n1"], &["ps"])).ok().stdout;
    assert!(
        ps1.lines()
            .any(|l| l.starts_with("n2 ") && l.contains("running")),
        "{ps1}"
    );
    let ps2 = root
        .run(&inside(&["n1", "n2"], &["ps", "--json"]))
        .ok()
        .stdout;
    let rows: Value = serde_json::from_str(&ps2).unwrap();
    assert_eq!(rows[0]["name"], "n3", "{ps2}");
    // From the host, the whole tree as parent/child.
    let rows = tree(&root, false);
    let names: Vec<&str> = rows.iter().filter_map(|r| r["name"].as_str()).collect();
    assert_eq!(names, ["n1", "n1/n2", "n1/n2/n3"]);
    assert!(rows.iter().all(|r| r["status"] == "running"), "{rows:?}");
    let plain = root.ok(&["ps", "--tree"]);
    assert!(plain.lines().any(|l| l.starts_with("n1/n2/n3 ")), "{plain}");

    // Real programs three levels down: busybox sh and python3.
    let out = root
        .run(&inside(
            &["n1", "n2"],
            &["exec", "n3", "--", "busybox", "sh", "-c", "echo $((6 * 7))"],
        ))
        .ok();
    assert_eq!(out.stdout, "42\n", "{out}");
    let out = root
        .run(&inside(
            &["n1", "n2"],
            &[
                "exec",
                "n3",
                "--",
                "python3",
                "-c",
                "import os; print(os.getpid())",
            ],
        ))
        .ok();
    assert!(
        out.stdout.trim().parse::<i32>().is_ok_and(|p| p > 1),
        "{out}"
    );

    // The boxes' cgroups nest as the boxes do, below the host's box cgroup.
    let n1_dirs = box_dirs(&root, "n1");
    let pids_dir = n1_dirs
        .iter()
        .find(|d| d.join("pids.max").exists())
        .expect("n1 has a pids cgroup")
        .clone();
    let deep: Vec<PathBuf> = subtree(std::slice::from_ref(&pids_dir))
        .into_iter()
        .filter(|d| {
            d.strip_prefix(&pids_dir)
                .is_ok_and(|r| r.components().count() == 2)
                && d.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("nestbox-"))
        })
        .collect();
    assert_eq!(deep.len(), 1, "n3's cgroup below n2's below n1's: {deep:?}");
    // The unmasked procfs and sysfs a nest box keeps for its boxes are out of reach.
    let out = root
        .run(&inside(
            &[],
            &[
                "exec",
                "n1",
                "--",
                "sh",
                "-c",
                "ls -A /dev/.nestbox; umount /dev/.nestbox 2>/dev/null && echo unmounted; true",
            ],
        ))
        .ok();
    assert_eq!(out.stdout, "", "{out}");

    // rm inside removes that box only.
    root.run(&inside(&["n1", "n2"], &["rm", "-f", "n3"])).ok();
    let rows = tree(&root, true);
    assert!(row(&rows, "n1/n2/n3").is_none(), "{rows:?}");
    assert!(!pid_alive(n3));
    start(&root, &["n1", "n2"], "n3", &[]);

    // rm of the outermost box removes its whole subtree.
    let pids: Vec<i32> = ["n1", "n1/n2", "n1/n2/n3"]
        .iter()
        .map(|n| host_pid(&root, n))
        .collect();
    let monitors: Vec<i32> = pids.iter().map(|p| parent_of(*p)).collect();
    let all_dirs = subtree(&n1_dirs);
    assert!(all_dirs.len() >= 3, "{all_dirs:?}");
    let veth = root.inspect("n1")["state"]["network"]["host_veth"]
        .as_str()
        .map(str::to_string);
    root.run(&["rm", "-f", "n1"]).ok();
    wait_for(
        "the boxes' processes to end",
        Duration::from_secs(10),
        || pids.iter().chain(&monitors).all(|p| !pid_alive(*p)),
    );
    let left: Vec<&PathBuf> = all_dirs.iter().filter(|d| d.exists()).collect();
    assert!(left.is_empty(), "cgroups left: {left:?}");
    assert!(
        mounts_under(root.path()).is_empty(),
        "{:?}",
        mounts_under(root.path())
    );
    if let Some(v) = veth {
        assert!(
            !Path::new("/sys/class/net").join(&v).exists(),
            "veth {v} left"
        );
    }
    assert!(tree(&root, true).is_empty());
}

#[test]
fn limits_carved_from_the_parent_hold() {
    let Some(root) = TestRoot::new("limits_carved_from_the_parent_hold") else {
        return;
    };
    start(
        &root,
        &[],
        "lim",
        &[
            "--nest",
            "--network",
            "none",
            "--memory",
            "128m",
            "--pids",
            "64",
        ],
    );
    // A box inside asks for 1 GiB and takes 300 MiB: the parent's 128 MiB
    // bounds it, and the OOM killer ends it there.
    let out = root.run(&inside(
        &["lim"],
        &[
            "run",
            "--rm",
            "--memory",
            "1g",
            "--",
            "python3",
            "-c",
            "b = bytearray(300 << 20)\nprint('allocated')",
        ],
    ));
    assert_eq!(out.code, 137, "killed by the OOM killer\n{out}");
    assert!(!out.stdout.contains("allocated"), "{out}");
    assert!(out.stderr.contains("OOM"), "{out}");
    assert_eq!(root.status("lim").as_deref(), Some("running"));
    // A fork bomb in a box inside, with a pids limit above the parent's (or
    // none), stops at the parent's 64.
    let bomb = "import os, time
kids, err = [], None
for _ in range(500):
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    kids.append(pid)
print(len(kids), err, flush=True)
for k in kids:
    os.kill(k, 9)
";
    for extra in [&[][..], &["--pids", "10000"][..]] {
        let mut args = vec!["run", "--rm"];
        args.extend_from_slice(extra);
        args.extend(["--", "python3", "-c", bomb]);
        let out = root.run(&inside(&["lim"], &args)).ok();
        let mut f = out.stdout.split_whitespace();
        let forks: usize = f.next().and_then(|n| n.parse().ok()).unwrap_or(999);
        assert!(
            forks < 64,
            "forks {forks}: the parent's pids limit must stop it\n{out}"
        );
        assert_eq!(f.next(), Some("11"), "EAGAIN\n{out}");
    }
    assert_eq!(root.status("lim").as_deref(), Some("running"));
    // The box's own limits stay root's: its root cannot raise them.
    let out = root.run(&inside(
        &[],
        &[
            "exec",
            "lim",
            "--",
            "sh",
            "-c",
            "echo max > /sys/fs/cgroup/pids/pids.max",
        ],
    ));
    assert_ne!(out.code, 0, "{out}");
    let dir = box_dirs(&root, "lim")
        .into_iter()
        .find(|d| d.join("pids.max").exists())
        .unwrap();
    assert_eq!(read_trimmed(&dir.join("pids.max")), "64");
}

/// CPU time the cgroup (subtree) `dir` of the v1 cpuacct hierarchy has used, in ns.
fn cpuacct_usage(dir: &Path) -> u64 {
    read_trimmed(&dir.join("cpuacct.usage")).parse().unwrap()
}

/// A box inside a nest box capped at half a CPU asks for two CPUs and keeps
/// two busy loops running: the parent's cap bounds what the whole subtree
/// uses (measured from the host), and the child's own cap is written as the
/// parent's (cgroup v1 refuses a larger one).
#[test]
fn a_childs_cpu_is_bounded_by_its_parents_cap() {
    let Some(root) = TestRoot::new("a_childs_cpu_is_bounded_by_its_parents_cap") else {
        return;
    };
    start(
        &root,
        &[],
        "half",
        &["--nest", "--network", "none", "--cpus", "0.5"],
    );
    root.ok(&inside(
        &["half"],
        &[
            "run",
            "-d",
            "--name",
            "hog",
            "--cpus",
            "2",
            "--",
            "sh",
            "-c",
            "while :; do :; done & while :; do :; done",
        ],
    ));
    let acct = box_dirs(&root, "half")
        .into_iter()
        .find(|d| d.join("cpuacct.usage").exists())
        .expect("the nest box's cpuacct cgroup");
    // The child's cgroup, below the parent's: its cap is the parent's share.
    let quota_dirs: Vec<PathBuf> = subtree(&box_dirs(&root, "half"))
        .into_iter()
        .filter(|d| d.join("cpu.cfs_quota_us").exists())
        .collect();
    let child_quotas: Vec<String> = quota_dirs
        .iter()
        .filter(|d| !box_dirs(&root, "half").contains(d))
        .map(|d| read_trimmed(&d.join("cpu.cfs_quota_us")))
        .filter(|q| q != "-1")
        .collect();
    assert_eq!(
        child_quotas,
        ["50000"],
        "the child's cap, capped at the parent's"
    );
    // Let the loops run, then measure 3 s of wall time.
    std::thread::sleep(Duration::from_millis(500));
    let (t0, u0) = (std::time::Instant::now(), cpuacct_usage(&acct));
    std::thread::sleep(Duration::from_secs(3));
    let (wall, used) = (
        t0.elapsed().as_nanos() as f64,
        (cpuacct_usage(&acct) - u0) as f64,
    );
    let cpus = used / wall;
    assert!(
        cpus <= 0.5 * 1.1,
        "the subtree used {cpus:.2} CPUs; its parent is capped at 0.5"
    );
    assert!(cpus >= 0.3, "the busy loops ran: {cpus:.2} CPUs");
    root.ok(&["rm", "-f", "half"]);
}

/// A box inside a nest box capped at 8 Mbit/s out (`--net-rate`) sends to a
/// box outside through its parent's network (`--network host` inside: a box
/// inside has no network of its own to exceed it with): what arrives, timed
/// by the receiver, stays within the parent's rate.
#[test]
fn a_childs_traffic_is_bounded_by_its_parents_rate() {
    let Some(root) = TestRoot::new("a_childs_traffic_is_bounded_by_its_parents_rate") else {
        return;
    };
    // The receiver: counts the bytes of one connection and the seconds from
    // its first byte to its end.
    root.ok(&[
        "run",
        "-d",
        "--name",
        "sink",
        "--",
        "python3",
        "-c",
        "import socket, time
s = socket.socket(); s.bind(('0.0.0.0', 7100)); s.listen(1)
c, _ = s.accept(); b = c.recv(65536); t0 = time.time(); n = len(b)
while b:
    b = c.recv(65536); n += len(b)
print('got', n, time.time() - t0, flush=True)",
    ]);
    let sink = root.inspect("sink")["state"]["network"]["address"]
        .as_str()
        .expect("the receiver's address")
        .to_string();
    start(&root, &[], "capped", &["--nest", "--net-rate", "8mbit"]);
    let send = format!(
        "import socket, time
c = socket.create_connection(('{sink}', 7100)); t0 = time.time(); b = b'x' * 65536
while time.time() - t0 < 3:
    c.sendall(b)
c.close()"
    );
    let out = root
        .run(&inside(
            &["capped"],
            &[
                "run",
                "--rm",
                "--network",
                "host",
                "--",
                "python3",
                "-c",
                &send,
            ],
        ))
        .ok();
    assert!(out.stderr.is_empty(), "{out}");
    wait_for("the receiver's count", Duration::from_secs(60), || {
        root.run(&["logs", "sink"]).stdout.contains("got")
    });
    let logged = root.run(&["logs", "sink"]).stdout;
    let f: Vec<&str> = logged.split_whitespace().collect();
    let (bytes, secs): (f64, f64) = (f[1].parse().unwrap(), f[2].parse().unwrap());
    let mbit = bytes * 8.0 / secs / 1e6;
    assert!(
        mbit <= 8.0 * 1.15,
        "{mbit:.2} Mbit/s arrived from a box inside a parent capped at 8 ({logged})"
    );
    assert!(
        mbit >= 4.0,
        "the box inside sent: {mbit:.2} Mbit/s ({logged})"
    );
    root.ok(&["rm", "-f", "capped", "sink"]);
}

/// A bridged box inside a nest box with `--net-rate 8mbit` sends for 3 s to
/// another bridged box inside: the inner network's HTB tree (made by the
/// nestbox inside, in the nest box's namespace) holds it to the cap.
#[test]
fn a_bridged_box_inside_a_nest_box_keeps_to_its_rate_cap() {
    let Some(root) = TestRoot::new("a_bridged_box_inside_a_nest_box_keeps_to_its_rate_cap") else {
        return;
    };
    start(&root, &[], "n", &["--nest"]);
    let sink = "import socket, time
s = socket.socket(); s.bind(('0.0.0.0', 7100)); s.listen(1)
print('ready', flush=True)
c, _ = s.accept(); b = c.recv(65536); t0 = time.time(); n = len(b)
while b:
    b = c.recv(65536); n += len(b)
print('got', n, time.time() - t0, flush=True)";
    let args = [
        "run",
        "-d",
        "--name",
        "sink",
        "--network",
        "bridge",
        "--",
        "python3",
        "-c",
        sink,
    ];
    let out = root.run_timeout(&inside(&["n"], &args), START).ok();
    assert_eq!(out.stdout.trim(), "sink", "{out}");
    wait_for("the sink to listen", Duration::from_secs(30), || {
        root.run(&inside(&["n"], &["logs", "sink"]))
            .stdout
            .contains("ready")
    });
    let addr = address_of(&root, &["n"], "sink");
    let send = format!(
        "import socket, time
c = socket.create_connection(('{addr}', 7100)); t0 = time.time(); b = b'x' * 65536
while time.time() - t0 < 3:
    c.sendall(b)
c.shutdown(socket.SHUT_WR); c.recv(1)"
    );
    // The sender waits for the sink to have read everything (its end
    // closes): a box that ends with data still queued loses its class, and
    // what is left goes out unshaped, unclassified.
    let args = [
        "run",
        "--rm",
        "--network",
        "bridge",
        "--net-rate",
        "8mbit",
        "--",
        "python3",
        "-c",
        &send,
    ];
    let out = root.run_timeout(&inside(&["n"], &args), START).ok();
    assert!(out.stderr.is_empty(), "{out}");
    wait_for("the receiver's count", Duration::from_secs(60), || {
        root.run(&inside(&["n"], &["logs", "sink"]))
            .stdout
            .contains("got")
    });
    let logged = root.run(&inside(&["n"], &["logs", "sink"])).stdout;
    let line = logged.lines().find(|l| l.starts_with("got")).unwrap();
    let f: Vec<&str> = line.split_whitespace().collect();
    let (bytes, secs): (f64, f64) = (f[1].parse().unwrap(), f[2].parse().unwrap());
    let mbit = bytes * 8.0 / secs / 1e6;
    eprintln!("capped box inside a nest box: {mbit:.2} Mbit/s ({line})");
    assert!(
        mbit <= 8.0 * 1.15,
        "{mbit:.2} Mbit/s from a box capped at 8 inside a nest box ({logged})"
    );
    assert!(
        mbit >= 4.0,
        "the box inside sent: {mbit:.2} Mbit/s ({logged})"
    );
    root.run(&inside(&["n"], &["rm", "-f", "sink"])).ok();
    root.ok(&["rm", "-f", "n"]);
}

#[test]
fn gc_after_kill_9_at_any_level_leaves_nothing() {
    let Some(root) = TestRoot::new("gc_after_kill_9_at_any_level_leaves_nothing") else {
        return;
    };
    start(&root, &[], "g1", &["--nest", "--network", "none"]);
    let g1_dirs = box_dirs(&root, "g1");
    let nested_dirs = || -> Vec<PathBuf> {
        subtree(&g1_dirs)
            .into_iter()
            .filter(|d| !g1_dirs.contains(d))
            .collect()
    };
    for victim in ["g1/g2/g3", "g1/g2"] {
        start(&root, &["g1"], "g2", &["--nest"]);
        start(&root, &["g1", "g2"], "g3", &[]);
        assert!(!nested_dirs().is_empty());
        let inits: Vec<i32> = ["g1/g2", "g1/g2/g3"]
            .iter()
            .map(|n| host_pid(&root, n))
            .collect();
        // SIGKILL the victim's monitor: its box (and the boxes in it) end
        // with it, and leave their cgroups, records and layers behind.
        let monitor = parent_of(host_pid(&root, victim));
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(monitor),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        let dead_inits: Vec<i32> = if victim == "g1/g2" {
            inits.clone()
        } else {
            inits[1..].to_vec()
        };
        wait_for("the killed box to end", Duration::from_secs(10), || {
            dead_inits.iter().all(|p| !pid_alive(*p))
        });
        assert_eq!(
            row(&tree(&root, true), victim).map(|r| r["status"].clone()),
            Some(Value::from("dead"))
        );
        // gc on the host reaches into the running box (and deeper).
        let out = root.run(&["gc"]).ok();
        let leaf = victim.rsplit('/').next().unwrap();
        assert!(
            out.stdout.contains(&format!("removed dead box {leaf}")),
            "{out}"
        );
        let rows = tree(&root, true);
        assert!(row(&rows, victim).is_none(), "{rows:?}");
        if victim == "g1/g2/g3" {
            // Its parent is untouched.
            assert_eq!(row(&rows, "g1/g2").unwrap()["status"], "running");
            root.run(&inside(&["g1"], &["rm", "-f", "g2"])).ok();
        }
        assert!(nested_dirs().is_empty(), "{:?}", nested_dirs());
        // Nothing of the boxes inside is left in g1's state directory.
        let out = root
            .run(&inside(
                &[],
                &[
                    "exec",
                    "g1",
                    "--",
                    "sh",
                    "-c",
                    "ls /var/lib/nestbox/boxes /run/nestbox/boxes",
                ],
            ))
            .ok();
        assert_eq!(
            out.stdout
                .split_whitespace()
                .filter(|l| !l.ends_with(':'))
                .count(),
            0,
            "{out}"
        );
    }
    // SIGKILL the outermost monitor: everything ends; gc takes it all.
    start(&root, &["g1"], "g2", &["--nest"]);
    start(&root, &["g1", "g2"], "g3", &[]);
    let inits: Vec<i32> = ["g1", "g1/g2", "g1/g2/g3"]
        .iter()
        .map(|n| host_pid(&root, n))
        .collect();
    let all_dirs = subtree(&g1_dirs);
    let monitor = parent_of(inits[0]);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(monitor),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_for("every level to end", Duration::from_secs(10), || {
        inits.iter().all(|p| !pid_alive(*p))
    });
    let out = root.run(&["gc"]).ok();
    assert!(out.stdout.contains("removed dead box g1"), "{out}");
    let left: Vec<&PathBuf> = all_dirs.iter().filter(|d| d.exists()).collect();
    assert!(left.is_empty(), "cgroups left: {left:?}");
    assert!(mounts_under(root.path()).is_empty());
    assert!(root.names().is_empty());
}

#[test]
fn stopping_a_parent_ends_its_subtree() {
    let Some(root) = TestRoot::new("stopping_a_parent_ends_its_subtree") else {
        return;
    };
    start(&root, &[], "s1", &["--nest", "--network", "none"]);
    start(&root, &["s1"], "s2", &["--nest"]);
    start(&root, &["s1", "s2"], "s3", &[]);
    let pids: Vec<i32> = ["s1", "s1/s2", "s1/s2/s3"]
        .iter()
        .map(|n| host_pid(&root, n))
        .collect();
    let dirs = subtree(&box_dirs(&root, "s1"));
    root.run(&["stop", "-t", "1", "s1"]).ok();
    assert_eq!(root.status("s1").as_deref(), Some("exited"));
    assert!(pids.iter().all(|p| !pid_alive(*p)));
    let left: Vec<&PathBuf> = dirs.iter().filter(|d| d.exists()).collect();
    assert!(left.is_empty(), "cgroups left: {left:?}");
    assert_eq!(tree(&root, false).len(), 0);
}

#[test]
fn inside_a_box_the_network_defaults_to_none_and_freeze_works() {
    let Some(root) = TestRoot::new("inside_a_box_the_network_defaults_to_none_and_freeze_works")
    else {
        return;
    };
    start(&root, &[], "w1", &["--nest", "--network", "none"]);
    // The default inside: loopback only.
    let out = root
        .run(&inside(
            &["w1"],
            &["run", "--rm", "--", "sh", "-c", "ls /sys/class/net"],
        ))
        .ok();
    assert_eq!(
        out.stdout.split_whitespace().collect::<Vec<_>>(),
        ["lo"],
        "{out}"
    );
    // A bridge inside, in the nest box's own network namespace (here one
    // with only its loopback): the box gets eth0 with an address of the
    // inner network (see the bridge tests below).
    let out = root
        .run(&inside(
            &["w1"],
            &[
                "run",
                "--rm",
                "--network",
                "bridge",
                "--",
                "sh",
                "-c",
                "ls /sys/class/net; cat /sys/class/net/eth0/operstate",
            ],
        ))
        .ok();
    assert_eq!(
        out.stdout.split_whitespace().collect::<Vec<_>>(),
        ["eth0", "lo", "up"],
        "{out}"
    );
    // A nest box sharing the host's network has no namespace of its own to
    // make a bridge in: one clear line.
    start(&root, &[], "w2", &["--nest", "--network", "host"]);
    let out = root.run(&inside(
        &["w2"],
        &["run", "--rm", "--network", "bridge", "--", "true"],
    ));
    assert_error(&out, 125, "needs the box's own network namespace");
    // Other boxes run inside it: its own cgroup mounts over the host's
    // (bound with the host's `/sys`) are the ones used.
    start(&root, &["w2"], "h1", &[]);
    assert_eq!(
        row(&tree(&root, false), "w2/h1").map(|r| r["status"].clone()),
        Some(Value::from("running"))
    );
    let out = root
        .run(&inside(
            &["w2"],
            &["run", "--rm", "--", "sh", "-c", "echo inside"],
        ))
        .ok();
    assert_eq!(out.stdout.trim(), "inside", "{out}");
    root.run(&["rm", "-f", "w2"]).ok();
    // freeze inside: ptrace and the freezer cgroup work in the box's user
    // namespace.
    start(&root, &["w1"], "f2", &[]);
    let out = root
        .run(&inside(&["w1"], &["freeze", "f2", "--as", "t2"]))
        .ok();
    assert_eq!(out.stdout.trim(), "t2", "{out}");
    let out = root.run(&inside(&["w1"], &["ps", "--json"])).ok();
    assert!(out.stdout.contains("\"frozen\""), "{out}");
    // A clone inside (see the clone tests below for more).
    let out = root.run(&inside(&["w1"], &["clone", "t2", "-d", "--name", "c2"]));
    assert_eq!(out.ok().stdout.trim(), "c2");
    assert_eq!(
        row(&tree(&root, false), "w1/c2").map(|r| r["status"].clone()),
        Some(Value::from("running"))
    );
    // A box with a template and a clone inside is not saved with them: one
    // line, and they run on.
    let out = root.run(&["freeze", "w1"]);
    assert_error(
        &out,
        125,
        "box \"w1\" could not suspend the boxes inside it: box \"",
    );
    assert_eq!(
        row(&tree(&root, false), "w1/c2").map(|r| r["status"].clone()),
        Some(Value::from("running"))
    );
}

/// `inspect NAME` by the nestbox inside the box at `path`.
#[track_caller]
fn inspect_inside(root: &TestRoot, path: &[&str], name: &str) -> Value {
    let out = root.run(&inside(path, &["inspect", name])).ok();
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("inspect is not JSON: {e}\n{out}"))
}

/// The address of box `name` on its network (`inspect`), inside the box at
/// `path` (the host for an empty path).
#[track_caller]
fn address_of(root: &TestRoot, path: &[&str], name: &str) -> String {
    let v = if path.is_empty() {
        root.inspect(name)
    } else {
        inspect_inside(root, path, name)
    };
    v["state"]["network"]["address"]
        .as_str()
        .unwrap_or_else(|| panic!("{path:?}/{name} has no address: {v}"))
        .to_string()
}

/// Python: GET `URL` (argv[1]) and print the status and the first line of
/// the body, or `error: …`.
const HTTP_GET: &str = "import sys, urllib.request\n\
try:\n\
\x20   r = urllib.request.urlopen(sys.argv[1], timeout=10)\n\
\x20   print(r.status, r.read().decode(errors='replace').splitlines()[0])\n\
except Exception as e:\n\
\x20   print('error:', e)\n";

/// GET `url` from box `from` inside the box at `path`: what [`HTTP_GET`] printed.
fn get_from(root: &TestRoot, path: &[&str], from: &str, url: &str) -> String {
    let args = ["exec", from, "--", "python3", "-c", HTTP_GET, url];
    root.run(&inside(path, &args))
        .ok()
        .stdout
        .trim()
        .to_string()
}

/// GET / from the host over TCP at `addr`: the raw answer ("" on failure).
fn get_from_host(addr: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut c) = std::net::TcpStream::connect_timeout(
        &addr.parse().expect("an address"),
        Duration::from_secs(5),
    ) else {
        return String::new();
    };
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut answer = String::new();
    if c.write_all(b"GET / HTTP/1.0\r\n\r\n").is_ok() {
        let _ = c.read_to_string(&mut answer);
    }
    answer
}

/// Links in the network namespace of the box at `path`.
fn links_inside(root: &TestRoot, path: &[&str]) -> Vec<String> {
    let args = ["ls", "/sys/class/net"];
    let mut full = inside(&path[..path.len() - 1], &[]);
    full.extend(["exec", path[path.len() - 1], "--"]);
    full.extend(args);
    let out = root.run(&full).ok();
    out.stdout.split_whitespace().map(str::to_string).collect()
}

#[test]
fn bridged_boxes_inside_a_nest_box_reach_each_other_the_outside_and_the_host() {
    let Some(root) =
        TestRoot::new("bridged_boxes_inside_a_nest_box_reach_each_other_the_outside_and_the_host")
    else {
        return;
    };
    // A server on the host's network, outside the nest box.
    let out = root
        .run(&[
            "run",
            "-d",
            "--name",
            "web",
            "--workdir",
            "/tmp",
            "--",
            "python3",
            "-m",
            "http.server",
            "8000",
        ])
        .ok();
    assert_eq!(out.stdout.trim(), "web", "{out}");
    let web = address_of(&root, &[], "web");
    wait_for("web to listen", Duration::from_secs(30), || {
        get_from_host(&format!("{web}:8000")).starts_with("HTTP/1.0 200")
    });
    // The nest box, bridged on the host (the default as root).
    start(&root, &[], "n", &["--nest"]);
    let nest = address_of(&root, &[], "n");
    let nest_veth = root.inspect("n")["state"]["network"]["host_veth"]
        .as_str()
        .expect("the nest box's host veth")
        .to_string();
    // Two bridged boxes inside: a server publishing 8080 as the nest box's
    // 9090, and a client.
    http_server_inside(
        &root,
        &["n"],
        "srv",
        &["--network", "bridge", "-p", "9090:8080"],
    );
    start(&root, &["n"], "cli", &["--network", "bridge"]);
    let srv = address_of(&root, &["n"], "srv");
    let cli = address_of(&root, &["n"], "cli");
    assert_ne!(srv, cli);
    // The inner network is the nest box's own: its own bridge and subnet,
    // not the host's.
    let inner = root
        .run(&inside(&["n"], &["network", "inspect", "default"]))
        .ok();
    let inner: Value = serde_json::from_str(&inner.stdout).unwrap();
    let host_net: Value =
        serde_json::from_str(&root.ok(&["network", "inspect", "default"])).unwrap();
    assert_ne!(inner["subnet"], host_net["subnet"], "{inner}");
    assert!(srv.starts_with(
        inner["subnet"]
            .as_str()
            .unwrap()
            .split('.')
            .take(2)
            .collect::<Vec<_>>()
            .join(".")
            .as_str()
    ));
    // By address and by name, box to box.
    wait_for("srv to listen", Duration::from_secs(30), || {
        get_from(&root, &["n"], "cli", &format!("http://{srv}:8080/")).starts_with("200 ")
    });
    let by_name = get_from(&root, &["n"], "cli", "http://srv:8080/");
    assert!(by_name.starts_with("200 "), "{by_name}");
    // Out of the nest box, through NAT: the host-level server sees the nest
    // box's address, not the inner box's.
    let out = get_from(&root, &["n"], "cli", &format!("http://{web}:8000/"));
    assert!(out.starts_with("200 "), "{out}");
    let logs = root.run(&["logs", "web"]).ok();
    let text = format!("{}{}", logs.stdout, logs.stderr);
    assert!(text.contains(&format!("{nest} - - ")), "{text}");
    assert!(!text.contains(&format!("{cli} - - ")), "{text}");
    // The published port, on the nest box's address, from the host.
    let answer = get_from_host(&format!("{nest}:9090"));
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer:?}");
    // The nest box's network namespace holds the inner bridge and a veth per box;
    // the guard is the nftables bridge table naming both veths.
    let links = links_inside(&root, &["n"]);
    let veths: Vec<&String> = links.iter().filter(|l| l.starts_with("nbv")).collect();
    assert_eq!(veths.len(), 2, "{links:?}");
    let bridge = inner["bridge"].as_str().unwrap().to_string();
    assert!(links.contains(&bridge), "{links:?}");
    let table = format!("nestbox-{bridge}");
    let guard = root
        .run(&inside(
            &[],
            &["exec", "n", "--", "nft", "list", "table", "bridge", &table],
        ))
        .ok();
    for v in &veths {
        assert!(guard.stdout.contains(v.as_str()), "{guard}");
    }
    // Bad input: a subnet that overlaps the nest box's own route, in one line.
    let out = root.run(&inside(
        &["n"],
        &[
            "network",
            "create",
            "clash",
            "--subnet",
            host_net["subnet"].as_str().unwrap(),
        ],
    ));
    assert_error(&out, 125, "overlaps host route");
    assert_eq!(out.stderr.trim().lines().count(), 1, "{out}");
    // A network made inside goes with `network rm`, bridge and all.
    let out = root
        .run(&inside(&["n"], &["network", "create", "side"]))
        .ok();
    let side: Value = serde_json::from_str(
        &root
            .run(&inside(&["n"], &["network", "inspect", "side"]))
            .ok()
            .stdout,
    )
    .unwrap();
    let side_bridge = side["bridge"].as_str().unwrap().to_string();
    let args = [
        "run",
        "--rm",
        "--network",
        "side",
        "--",
        "cat",
        "/sys/class/net/eth0/operstate",
    ];
    let up = root.run_timeout(&inside(&["n"], &args), START).ok();
    assert_eq!(up.stdout.trim(), "up", "{out}\n{up}");
    root.run(&inside(&["n"], &["network", "rm", "side"])).ok();
    let links = links_inside(&root, &["n"]);
    assert!(
        !links.iter().any(|l| l.starts_with(&side_bridge)),
        "{links:?}"
    );
    let tables = root
        .run(&inside(&[], &["exec", "n", "--", "nft", "list", "tables"]))
        .ok();
    assert!(!tables.stdout.contains(&side_bridge), "{tables}");
    assert!(
        tables.stdout.contains(&format!("bridge nestbox-{bridge}")),
        "{tables}"
    );
    // After rm -f inside, no inner veth is left in the nest box's namespace.
    root.run(&inside(&["n"], &["rm", "-f", "srv", "cli"])).ok();
    let links = links_inside(&root, &["n"]);
    assert!(!links.iter().any(|l| l.starts_with("nbv")), "{links:?}");
    let guard = root
        .run(&inside(
            &[],
            &["exec", "n", "--", "nft", "list", "table", "bridge", &table],
        ))
        .ok();
    assert!(!guard.stdout.contains("nbv"), "{guard}");
    // And after rm -f of the nest box from the host, nothing of it is left
    // on the host (the rest is checked when the test root is dropped).
    root.run(&["rm", "-f", "n", "web"]).ok();
    assert!(
        !Path::new("/sys/class/net").join(&nest_veth).exists(),
        "{nest_veth} is left"
    );
}

/// An isolated network made inside a nest box: its boxes reach each other
/// only through a published port on the gateway (the nftables guard's
/// isolated rules), never directly.
#[test]
fn an_isolated_network_inside_a_nest_box_keeps_its_boxes_apart() {
    let Some(root) = TestRoot::new("an_isolated_network_inside_a_nest_box_keeps_its_boxes_apart")
    else {
        return;
    };
    start(&root, &[], "n", &["--nest"]);
    root.run(&inside(&["n"], &["network", "create", "iso", "--isolated"]))
        .ok();
    http_server_inside(&root, &["n"], "a", &["--network", "iso", "-p", "9191:8080"]);
    start(&root, &["n"], "b", &["--network", "iso"]);
    let a = address_of(&root, &["n"], "a");
    let net: Value = serde_json::from_str(
        &root
            .run(&inside(&["n"], &["network", "inspect", "iso"]))
            .ok()
            .stdout,
    )
    .unwrap();
    let gateway = net["gateway"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| {
            // The subnet's first host.
            let subnet = net["subnet"].as_str().expect("the network's subnet");
            let base = subnet.split('/').next().unwrap();
            let mut o: Vec<u8> = base.split('.').map(|x| x.parse().unwrap()).collect();
            o[3] += 1;
            format!("{}.{}.{}.{}", o[0], o[1], o[2], o[3])
        });
    // Through the published port on the gateway: yes.
    wait_for(
        "a's port through the gateway",
        Duration::from_secs(30),
        || get_from(&root, &["n"], "b", &format!("http://{gateway}:9191/")).starts_with("200 "),
    );
    // Directly: no.
    let direct = get_from(&root, &["n"], "b", &format!("http://{a}:8080/"));
    assert!(direct.starts_with("error:"), "{direct}");
    root.run(&inside(&["n"], &["rm", "-f", "a", "b"])).ok();
    root.run(&inside(&["n"], &["network", "rm", "iso"])).ok();
    root.run(&["rm", "-f", "n"]).ok();
}

/// Python: send the Ethernet frames `FRAMES` (source MAC or 'self', source
/// address, payload: UDP 4000 → 5555) to `DMAC`/`DIP` from eth0.
const SEND_FORGED: &str = "import socket, struct\n\
def csum(b):\n\
\x20   s = sum(struct.unpack('!10H', b))\n\
\x20   s = (s >> 16) + (s & 0xffff)\n\
\x20   s += s >> 16\n\
\x20   return ~s & 0xffff\n\
def mac(m):\n\
\x20   return bytes.fromhex(m.replace(':', ''))\n\
own = open('/sys/class/net/eth0/address').read().strip()\n\
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)\n\
s.bind(('eth0', 0))\n\
for smac, sip, tag in FRAMES:\n\
\x20   body = tag.encode()\n\
\x20   udp = struct.pack('!HHHH', 4000, 5555, 8 + len(body), 0) + body\n\
\x20   ip = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0, socket.inet_aton(sip), socket.inet_aton(DIP))\n\
\x20   ip = ip[:10] + struct.pack('!H', csum(ip)) + ip[12:]\n\
\x20   s.send(mac(DMAC) + mac(own if smac == 'self' else smac) + b'\\x08\\x00' + ip + udp)\n\
print('sent')\n";

/// The nftables guard inside a nest box: forged frames dropped, genuine ones
/// arrive; then `gc` inside removes a SIGKILLed box's chain and address, and
/// a clone of a bridged template is refused in one line.
#[test]
fn a_box_inside_a_nest_box_cannot_send_with_a_spoofed_address() {
    let Some(root) = TestRoot::new("a_box_inside_a_nest_box_cannot_send_with_a_spoofed_address")
    else {
        return;
    };
    start(&root, &[], "n", &["--nest"]);
    let listener = "import socket\n\
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
s.bind(('0.0.0.0', 5555))\n\
print('ready', flush=True)\n\
while True:\n\
\x20   d, a = s.recvfrom(2000)\n\
\x20   print('got', a[0], d.decode(errors='replace'), flush=True)\n";
    let args = [
        "run",
        "-d",
        "--name",
        "r",
        "--network",
        "bridge",
        "--",
        "python3",
        "-c",
        listener,
    ];
    let out = root.run_timeout(&inside(&["n"], &args), START).ok();
    assert_eq!(out.stdout.trim(), "r", "{out}");
    start(&root, &["n"], "v", &["--network", "bridge"]);
    start(&root, &["n"], "s", &["--network", "bridge"]);
    wait_for("r to listen", Duration::from_secs(30), || {
        root.run(&inside(&["n"], &["logs", "r"]))
            .ok()
            .stdout
            .contains("ready")
    });
    let (r_ip, v_ip, s_ip) = (
        address_of(&root, &["n"], "r"),
        address_of(&root, &["n"], "v"),
        address_of(&root, &["n"], "s"),
    );
    let r_mac = root
        .run(&inside(
            &["n"],
            &["exec", "r", "--", "cat", "/sys/class/net/eth0/address"],
        ))
        .ok()
        .stdout
        .trim()
        .to_string();
    // From s: another box's address, a made-up one, a made-up MAC; then
    // the genuine frame, sent the same way, which must arrive.
    let frames = format!(
        "FRAMES = [('self', '{v_ip}', 'forged-ip'), ('self', '10.1.2.3', 'forged-outside'), \
         ('02:de:ad:be:ef:01', '{s_ip}', 'forged-mac'), ('self', '{s_ip}', 'genuine')]\n\
         DMAC = '{r_mac}'\nDIP = '{r_ip}'\n{SEND_FORGED}"
    );
    let out = root
        .run(&inside(
            &["n"],
            &["exec", "s", "--", "python3", "-c", &frames],
        ))
        .ok();
    assert!(out.stdout.contains("sent"), "{out}");
    wait_for(
        "the genuine frame to arrive",
        Duration::from_secs(10),
        || {
            root.run(&inside(&["n"], &["logs", "r"]))
                .ok()
                .stdout
                .contains("genuine")
        },
    );
    std::thread::sleep(Duration::from_millis(500));
    let log = root.run(&inside(&["n"], &["logs", "r"])).ok().stdout;
    assert!(log.contains(&format!("got {s_ip} genuine")), "{log}");
    assert!(!log.contains("forged"), "a forged frame arrived:\n{log}");
    // gc inside: a bridged box whose monitor was SIGKILLed loses its veth,
    // its guard chain and its address.
    let s_veth = inspect_inside(&root, &["n"], "s")["state"]["network"]["host_veth"]
        .as_str()
        .expect("s's host veth")
        .to_string();
    let bridge = inspect_inside(&root, &["n"], "s")["state"]["network"]["bridge"]
        .as_str()
        .expect("s's bridge")
        .to_string();
    let guard = |root: &TestRoot| {
        let table = format!("nestbox-{bridge}");
        let args = ["exec", "n", "--", "nft", "list", "table", "bridge", &table];
        root.run(&args).ok().stdout
    };
    assert!(guard(&root).contains(&s_veth), "{}", guard(&root));
    let boxes_inside = |root: &TestRoot| -> String {
        let net = root
            .run(&inside(&["n"], &["network", "inspect", "default"]))
            .ok();
        let v: Value = serde_json::from_str(&net.stdout).unwrap();
        v["boxes"].to_string()
    };
    assert!(
        boxes_inside(&root).contains(&s_ip),
        "{}",
        boxes_inside(&root)
    );
    let init = host_pid(&root, "n/s");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(parent_of(init)),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_for("s to end", Duration::from_secs(10), || !pid_alive(init));
    let out = root.run(&inside(&["n"], &["gc"])).ok();
    assert!(out.stdout.contains("removed dead box s"), "{out}");
    assert!(!guard(&root).contains(&s_veth), "{}", guard(&root));
    assert!(guard(&root).contains("jump box_"), "{}", guard(&root));
    assert!(!links_inside(&root, &["n"]).contains(&s_veth));
    assert!(
        !boxes_inside(&root).contains(&s_ip),
        "{}",
        boxes_inside(&root)
    );
    root.run(&inside(&["n"], &["rm", "-f", "r"])).ok();
    root.run(&["rm", "-f", "n"]).ok();
}

/// Clones of a bridged template inside a nest box (forked, and claimed from
/// its pool) each have an address of their own on the inner bridge, where
/// another box inside reaches them with the template's count continued and
/// their own name; the guard covers each clone's veth; their removal takes
/// their addresses and rules out again.
#[test]
fn clones_of_a_bridged_template_inside_a_nest_box_have_addresses_of_their_own() {
    let Some(root) =
        TestRoot::new("clones_of_a_bridged_template_inside_a_nest_box_have_addresses_of_their_own")
    else {
        return;
    };
    start(&root, &[], "n", &["--nest"]);
    let server = common::apps::PYTHON_POOL_SERVER.replace("'127.0.0.1'", "'0.0.0.0'");
    let args = [
        "run",
        "-d",
        "--name",
        "srv",
        "--network",
        "bridge",
        "--",
        "python3",
        "-c",
        &server,
    ];
    let out = root.run_timeout(&inside(&["n"], &args), START).ok();
    assert_eq!(out.stdout.trim(), "srv", "{out}");
    start(&root, &["n"], "cl", &["--network", "bridge"]);
    // GET / of `ip` from box cl, over the inner bridge: (count, hostname).
    let get = |ip: &str| {
        let code = format!(
            "import urllib.request; print(urllib.request.urlopen('http://{ip}:8080/', timeout=10).read().decode().strip())"
        );
        let out = root
            .run(&inside(
                &["n"],
                &["exec", "cl", "--", "python3", "-c", &code],
            ))
            .ok();
        let fields: Vec<String> = out.stdout.split_whitespace().map(str::to_string).collect();
        assert_eq!(fields.len(), 2, "answer of {ip}\n{out}");
        (fields[0].parse::<u64>().unwrap(), fields[1].clone())
    };
    let srv_ip = address_of(&root, &["n"], "srv");
    wait_for("srv to listen", Duration::from_secs(30), || {
        root.run(&inside(&["n"], &["logs", "srv"]))
            .ok()
            .stdout
            .contains("ready")
    });
    assert_eq!(get(&srv_ip).0, 1);
    assert_eq!(get(&srv_ip).0, 2);
    let out = root
        .run_timeout(
            &inside(&["n"], &["freeze", "srv", "--as", "ts", "--pool", "2"]),
            START,
        )
        .ok();
    assert_eq!(out.stdout.trim(), "ts", "{out}");
    // Three forked at once, and one claimed from the pool once it is full.
    let out = root
        .run_timeout(&inside(&["n"], &["clone", "ts", "-n", "3", "-d"]), START)
        .ok();
    let mut names: Vec<String> = out.stdout.lines().map(str::to_string).collect();
    assert_eq!(names.len(), 3, "{out}");
    wait_for("the pool to fill", Duration::from_secs(30), || {
        let v: Value = serde_json::from_str(
            &root
                .run(&inside(&["n"], &["template", "ls", "--json"]))
                .ok()
                .stdout,
        )
        .unwrap_or(Value::Null);
        v.as_array()
            .and_then(|a| a.first())
            .is_some_and(|t| t["pooled"].as_u64() == Some(2))
    });
    let out = root
        .run_timeout(
            &inside(&["n"], &["clone", "ts", "--name", "pc", "-d"]),
            START,
        )
        .ok();
    assert_eq!(out.stdout.trim(), "pc", "{out}");
    names.push("pc".into());
    let bridge = inspect_inside(&root, &["n"], "srv")["state"]["network"]["bridge"]
        .as_str()
        .expect("srv's bridge")
        .to_string();
    let guard = || {
        let table = format!("nestbox-{bridge}");
        let args = ["exec", "n", "--", "nft", "list", "table", "bridge", &table];
        root.run(&args).ok().stdout
    };
    let mut addresses = vec![srv_ip.clone()];
    let mut veths = Vec::new();
    for name in &names {
        let ip = address_of(&root, &["n"], name);
        assert!(
            !addresses.contains(&ip),
            "{name} has {ip}, taken: {addresses:?}"
        );
        addresses.push(ip.clone());
        assert_eq!(
            get(&ip),
            (3, name.clone()),
            "clone {name} at {ip} continues"
        );
        let veth = inspect_inside(&root, &["n"], name)["state"]["network"]["host_veth"]
            .as_str()
            .unwrap_or_else(|| panic!("{name} has no host veth"))
            .to_string();
        assert!(guard().contains(&veth), "no guard for {name}: {}", guard());
        veths.push(veth);
    }
    // Each goes on alone.
    assert_eq!(get(&addresses[1]).0, 4);
    assert_eq!(get(&addresses[1]).0, 5);
    assert_eq!(get(&addresses[2]).0, 4);
    let mut rm = vec!["rm", "-f"];
    rm.extend(names.iter().map(String::as_str));
    root.run_timeout(&inside(&["n"], &rm), START).ok();
    let net = root
        .run(&inside(&["n"], &["network", "inspect", "default"]))
        .ok()
        .stdout;
    for (ip, veth) in addresses[1..].iter().zip(&veths) {
        assert!(
            !net.contains(&format!("\"{ip}\"")),
            "{ip} still leased: {net}"
        );
        assert!(!guard().contains(veth), "{veth} still guarded: {}", guard());
        assert!(!links_inside(&root, &["n"]).contains(veth));
    }
    root.run(&["rm", "-f", "n"]).ok();
    root.assert_no_boxes();
}

/// GET / from the counter server of box `name`, a box of the nestbox inside
/// the box at `path`: (count, hostname).
#[track_caller]
fn get_inside(root: &TestRoot, path: &[&str], name: &str) -> (u64, String) {
    let code = "import urllib.request; \
                print(urllib.request.urlopen('http://127.0.0.1:8080/', timeout=10).read().decode().strip())";
    let out = root
        .run(&inside(path, &["exec", name, "--", "python3", "-c", code]))
        .ok();
    let fields: Vec<&str> = out.stdout.split_whitespace().collect();
    assert_eq!(fields.len(), 2, "answer of {path:?}/{name}\n{out}");
    (fields[0].parse().unwrap(), fields[1].to_string())
}

/// Start the counter server (`COUNT HOSTNAME` on 127.0.0.1:8080, counted by
/// a pool of 4 threads, which each clone must have too) as box `name` inside
/// the box at `path`, wait until it listens and warm it with `warm` requests.
fn warmed_server_inside(root: &TestRoot, path: &[&str], name: &str, warm: u64) {
    let args = [
        "run",
        "-d",
        "--name",
        name,
        "--",
        "python3",
        "-c",
        common::apps::PYTHON_POOL_SERVER,
    ];
    let out = root.run_timeout(&inside(path, &args), START).ok();
    assert_eq!(out.stdout.trim(), name, "{out}");
    wait_for(
        &format!("{name} to listen"),
        Duration::from_secs(30),
        || {
            root.run(&inside(path, &["logs", name]))
                .ok()
                .stdout
                .contains("ready")
        },
    );
    for i in 1..=warm {
        assert_eq!(get_inside(root, path, name), (i, name.to_string()));
    }
}

/// The names of the boxes the nestbox inside the box at `path` lists
/// (`ps --json`; `-a` with `all`).
fn names_inside(root: &TestRoot, path: &[&str], all: bool) -> Vec<String> {
    let mut args = vec!["ps", "--json"];
    if all {
        args.push("-a");
    }
    let out = root.run(&inside(path, &args)).ok();
    let rows: Value = serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}\n{out}"));
    rows.as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_string())
        .collect()
}

/// `template ls --json` of the nestbox inside the box at `path`: the row of
/// template `name`.
fn template_inside(root: &TestRoot, path: &[&str], name: &str) -> Value {
    let out = root.run(&inside(path, &["template", "ls", "--json"])).ok();
    let rows: Value = serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}\n{out}"));
    rows.as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == name)
        .unwrap_or_else(|| panic!("no template {name}\n{out}"))
        .clone()
}

/// The pids in the `cgroup.procs` files of cgroup directories `dirs`.
fn procs_in(dirs: &[PathBuf]) -> Vec<i32> {
    let mut pids: Vec<i32> = dirs
        .iter()
        .filter_map(|d| std::fs::read_to_string(d.join("cgroup.procs")).ok())
        .flat_map(|t| {
            t.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// `rm -f` the (top-level) nest box `top` from the host, and check that
/// nothing of it is left: no process that ran in it (its boxes', clones' and
/// pooled clones' processes, their monitors and inits, and its own monitor),
/// no cgroup of its subtree, no mount, no row of `ps --tree -a`.
#[track_caller]
fn rm_leaves_nothing(root: &TestRoot, top: &str) {
    let dirs = subtree(&box_dirs(root, top));
    let mut pids = procs_in(&dirs);
    pids.push(parent_of(host_pid(root, top)));
    assert!(pids.len() > 3, "{pids:?}");
    root.run(&["rm", "-f", top]).ok();
    wait_for(
        "every process of the box to end",
        Duration::from_secs(10),
        || pids.iter().all(|p| !pid_alive(*p)),
    );
    let left: Vec<&PathBuf> = dirs.iter().filter(|d| d.exists()).collect();
    assert!(left.is_empty(), "cgroups left: {left:?}");
    assert!(
        mounts_under(root.path()).is_empty(),
        "{:?}",
        mounts_under(root.path())
    );
    assert!(tree(root, true).is_empty());
}

/// Inside a nest box, as on a host: a warmed server is frozen and cloned
/// (`-n 3` and by name); every clone continues the template's state and then
/// goes its own way, under its own hostname, while the template stays as it
/// was; its processes and files are the template's root's; the nestbox
/// inside lists and removes the clones, the host sees them as `nest/clone`;
/// a clone frozen in turn is cloned; `rm -f` of the nest box from the host
/// leaves nothing.
#[test]
fn clones_inside_a_nest_box_continue_the_template_and_diverge() {
    let Some(root) = TestRoot::new("clones_inside_a_nest_box_continue_the_template_and_diverge")
    else {
        return;
    };
    start(&root, &[], "k1", &["--nest", "--network", "none"]);
    let k1 = ["k1"];
    warmed_server_inside(&root, &k1, "srv", 3);
    let out = root
        .run(&inside(&k1, &["freeze", "srv", "--as", "tpl"]))
        .ok();
    assert_eq!(out.stdout.trim(), "tpl", "{out}");
    let out = root
        .run(&inside(&k1, &["clone", "tpl", "-n", "3", "-d"]))
        .ok();
    let mut clones: Vec<String> = out.stdout.lines().map(str::to_string).collect();
    assert_eq!(clones.len(), 3, "{out}");
    let out = root
        .run(&inside(&k1, &["clone", "tpl", "-d", "--name", "named"]))
        .ok();
    assert_eq!(out.stdout.trim(), "named", "{out}");
    clones.push("named".into());

    // Each continues the template's counter (3 requests before the freeze)
    // under its own name, then counts on its own.
    for c in &clones {
        assert_eq!(get_inside(&root, &k1, c), (4, c.clone()));
    }
    for want in 5..=7 {
        assert_eq!(get_inside(&root, &k1, "named"), (want, "named".into()));
    }
    assert_eq!(get_inside(&root, &k1, &clones[0]), (5, clones[0].clone()));
    assert_eq!(get_inside(&root, &k1, &clones[1]), (5, clones[1].clone()));
    assert_eq!(get_inside(&root, &k1, "named").0, 8);

    // The template is untouched: still frozen, and a clone made now starts
    // from its state again.
    let rows = root.run(&inside(&k1, &["ps", "--json"])).ok().stdout;
    let rows: Value = serde_json::from_str(&rows).unwrap();
    let srv = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "srv")
        .unwrap();
    assert_eq!(srv["status"], "frozen", "{rows}");
    assert_eq!(template_inside(&root, &k1, "tpl")["clones"], 4);
    root.run(&inside(&k1, &["clone", "tpl", "-d", "--name", "late"]))
        .ok();
    assert_eq!(get_inside(&root, &k1, "late"), (4, "late".into()));
    clones.push("late".into());

    // ps inside lists them; the host shows them below the nest box.
    let names = names_inside(&root, &k1, false);
    for c in &clones {
        assert!(names.contains(c), "{c} in {names:?}");
    }
    let rows = tree(&root, false);
    for c in &clones {
        let r = row(&rows, &format!("k1/{c}")).unwrap_or_else(|| panic!("k1/{c} in {rows:?}"));
        assert_eq!(r["status"], "running", "{r}");
    }

    // The clone's processes and files are the template's root's: an identity
    // map over the template's ids inside, host uid 1000032768 (the upper half
    // of the nest box's range) outside.
    let out = root
        .run(&inside(
            &k1,
            &[
                "exec",
                "named",
                "--",
                "sh",
                "-c",
                "cat /proc/self/uid_map; touch /tmp/marker; stat -c %u /tmp/marker",
            ],
        ))
        .ok();
    let lines: Vec<String> = out.stdout.lines().map(squeeze).collect();
    assert_eq!(lines, ["0 0 32768", "0"], "{out}");
    let init = host_pid(&root, "k1/named");
    let children = std::fs::read_to_string(format!("/proc/{init}/task/{init}/children")).unwrap();
    let process: i32 = children.split_whitespace().next().unwrap().parse().unwrap();
    assert_eq!(
        status_of(process, "Uid").map(|u| squeeze(&u)).as_deref(),
        Some("1000032768 1000032768 1000032768 1000032768")
    );
    let id = root.run(&inside(&k1, &["inspect", "named"])).ok().stdout;
    let id: Value = serde_json::from_str(&id).unwrap();
    let id = id["state"]["id"].as_str().unwrap().to_string();
    let out = root
        .run(&inside(
            &[],
            &[
                "exec",
                "k1",
                "--",
                "sh",
                "-c",
                &format!("stat -c %u $(find /var/lib/nestbox/boxes/{id} -name marker)"),
            ],
        ))
        .ok();
    assert_eq!(out.stdout.trim(), "32768", "{out}");

    // rm inside removes a clone, and only it.
    let gone = clones.remove(2);
    let gone_init = host_pid(&root, &format!("k1/{gone}"));
    root.run(&inside(&k1, &["rm", "-f", &gone])).ok();
    assert!(!names_inside(&root, &k1, true).contains(&gone));
    assert!(row(&tree(&root, true), &format!("k1/{gone}")).is_none());
    assert!(!pid_alive(gone_init));
    assert_eq!(get_inside(&root, &k1, &clones[0]).0, 6);

    // A clone frozen in turn is a template like any other inside too (its
    // root is its template's: the uid its processes run as).
    root.run(&inside(&k1, &["freeze", &clones[0], "--as", "again"]))
        .ok();
    root.run(&inside(&k1, &["clone", "again", "-d", "--name", "grand"]))
        .ok();
    assert_eq!(get_inside(&root, &k1, "grand"), (7, "grand".into()));
    assert_eq!(get_inside(&root, &k1, "grand").0, 8);
    assert_eq!(get_inside(&root, &k1, "named").0, 9);

    rm_leaves_nothing(&root, "k1");
}

/// A pool inside a nest box: `freeze --pool 2` forks two clones ahead, a
/// `clone` claims one of them (its box is one of the pool's), which
/// continues the template under its name, and the pool is refilled.
#[test]
fn a_pool_of_clones_inside_a_nest_box_is_claimed_and_refilled() {
    let Some(root) = TestRoot::new("a_pool_of_clones_inside_a_nest_box_is_claimed_and_refilled")
    else {
        return;
    };
    start(&root, &[], "p1", &["--nest", "--network", "none"]);
    let p1 = ["p1"];
    warmed_server_inside(&root, &p1, "srv", 1);
    root.run(&inside(
        &p1,
        &["freeze", "srv", "--as", "tpl", "--pool", "2"],
    ))
    .ok();
    assert_eq!(template_inside(&root, &p1, "tpl")["pooled"], 2);
    // Pooled clones are not boxes yet.
    assert_eq!(names_inside(&root, &p1, true), ["srv"]);
    // The ids of the pool's clones, from their records.
    let pool_ids = || -> Vec<String> {
        let code = "import glob, json\n\
                    for f in sorted(glob.glob('/run/nestbox/boxes/pool.*/state.json')):\n    \
                    print(json.load(open(f))['id'])";
        let out = root
            .run(&inside(&[], &["exec", "p1", "--", "python3", "-c", code]))
            .ok();
        out.stdout.lines().map(str::to_string).collect()
    };
    let pooled = pool_ids();
    assert_eq!(pooled.len(), 2, "{pooled:?}");
    root.run(&inside(&p1, &["clone", "tpl", "-d", "--name", "first"]))
        .ok();
    let first: Value =
        serde_json::from_str(&root.run(&inside(&p1, &["inspect", "first"])).ok().stdout).unwrap();
    let first_id = first["state"]["id"].as_str().unwrap().to_string();
    assert!(
        pooled.contains(&first_id),
        "first ({first_id}) was claimed from the pool {pooled:?}"
    );
    assert_eq!(get_inside(&root, &p1, "first"), (2, "first".into()));
    wait_for("the pool to refill", Duration::from_secs(30), || {
        template_inside(&root, &p1, "tpl")["pooled"] == 2
    });
    root.run(&inside(&p1, &["clone", "tpl", "-d", "--name", "second"]))
        .ok();
    assert_eq!(get_inside(&root, &p1, "second"), (2, "second".into()));
    assert_eq!(get_inside(&root, &p1, "first"), (3, "first".into()));
    let rows = tree(&root, false);
    for c in ["p1/first", "p1/second"] {
        assert_eq!(
            row(&rows, c).map(|r| r["status"].clone()),
            Some(Value::from("running"))
        );
    }
    wait_for("the pool to refill", Duration::from_secs(30), || {
        template_inside(&root, &p1, "tpl")["pooled"] == 2
    });
    rm_leaves_nothing(&root, "p1");
}

/// Two levels: a template and its clones in a nest box inside a nest box.
#[test]
fn clones_inside_a_nest_box_inside_a_nest_box() {
    let Some(root) = TestRoot::new("clones_inside_a_nest_box_inside_a_nest_box") else {
        return;
    };
    start(&root, &[], "d1", &["--nest", "--network", "none"]);
    start(&root, &["d1"], "d2", &["--nest"]);
    let d2 = ["d1", "d2"];
    warmed_server_inside(&root, &d2, "srv", 2);
    root.run(&inside(&d2, &["freeze", "srv", "--as", "tpl"]))
        .ok();
    let out = root
        .run(&inside(
            &d2,
            &["clone", "tpl", "-n", "2", "-d", "--name", "c"],
        ))
        .ok();
    assert_eq!(
        out.stdout.lines().collect::<Vec<_>>(),
        ["c-1", "c-2"],
        "{out}"
    );
    assert_eq!(get_inside(&root, &d2, "c-1"), (3, "c-1".into()));
    assert_eq!(get_inside(&root, &d2, "c-1"), (4, "c-1".into()));
    assert_eq!(get_inside(&root, &d2, "c-2"), (3, "c-2".into()));
    let rows = tree(&root, false);
    for c in ["d1/d2/c-1", "d1/d2/c-2"] {
        assert_eq!(
            row(&rows, c).map(|r| r["status"].clone()),
            Some(Value::from("running"))
        );
    }
    // Level 2's template root is host uid 1000049152 (the upper half of
    // level 2's range), and so are its clones'.
    let init = host_pid(&root, "d1/d2/c-2");
    let children = std::fs::read_to_string(format!("/proc/{init}/task/{init}/children")).unwrap();
    let process: i32 = children.split_whitespace().next().unwrap().parse().unwrap();
    assert_eq!(
        status_of(process, "Uid").map(|u| squeeze(&u)).as_deref(),
        Some("1000049152 1000049152 1000049152 1000049152")
    );
    root.run(&inside(&d2, &["rm", "-f", "c-1"])).ok();
    assert!(row(&tree(&root, true), "d1/d2/c-1").is_none());
    rm_leaves_nothing(&root, "d1");
}

/// Start `python3 -m http.server 8080` (in /tmp) as box `name` with `opts`,
/// inside the box at `path`.
#[track_caller]
fn http_server_inside(root: &TestRoot, path: &[&str], name: &str, opts: &[&str]) {
    let mut args = vec!["run", "-d", "--name", name];
    args.extend_from_slice(opts);
    args.extend([
        "--workdir",
        "/tmp",
        "--",
        "python3",
        "-m",
        "http.server",
        "8080",
    ]);
    let out = root.run_timeout(&inside(path, &args), START).ok();
    assert_eq!(out.stdout.trim(), name, "{out}");
}

/// The host cgroup directories of box `name` and of everything below them.
fn subtree_of(root: &TestRoot, name: &str) -> Vec<PathBuf> {
    subtree(&box_dirs(root, name))
}

/// Box `name` on the host: a nest box (`--network none`) whose command is
/// the counter server, listening.
fn nest_server(root: &TestRoot, name: &str) {
    let args = [
        "run",
        "-d",
        "--name",
        name,
        "--nest",
        "--network",
        "none",
        "--",
        "python3",
        "-c",
        common::apps::PYTHON_POOL_SERVER,
    ];
    let out = root.run_timeout(&args, START).ok();
    assert_eq!(out.stdout.trim(), name, "{out}");
    root.wait_logged(name, "ready", Duration::from_secs(30));
}

/// With template `b1` inside nest box `nest` (whose command is the counter
/// server), `command` is refused in one line naming it, before anything
/// inside is stopped (a template inside is not saved with its nest box:
/// `template save` keeps it), and both go on as they were (the server
/// answers with count `count`); then `b1` is removed and the pool of the
/// nestbox inside drained.
#[track_caller]
fn refused_with_a_template_inside(root: &TestRoot, nest: &str, command: &[&str], count: u64) {
    start(root, &[nest], "b1", &[]);
    root.run(&inside(&[nest], &["freeze", "b1"])).ok();
    assert_error(
        &root.run(command),
        125,
        &format!(
            "box \"{nest}\" could not suspend the boxes inside it: box \"b1\" is a template: remove it"
        ),
    );
    assert_eq!(root.status(nest).as_deref(), Some("running"));
    assert_eq!(
        row(&tree(root, false), &format!("{nest}/b1")).map(|r| r["status"].clone()),
        Some(Value::from("frozen"))
    );
    assert_eq!(get_inside(root, &[], nest), (count, nest.to_string()));
    root.run(&inside(&[nest], &["rm", "-f", "b1"])).ok();
    root.run(&inside(&[nest], &["pool", "drain"])).ok();
}

/// Write `text` to a file of nest box `name`'s state directory.
fn set_mark(root: &TestRoot, name: &str, text: &str) {
    let script = format!("echo {text} > /var/lib/nestbox/mark");
    root.ok(&["exec", name, "--", "sh", "-c", &script]);
}

/// What [`set_mark`] wrote in nest box `name`'s state directory.
fn mark_of(root: &TestRoot, name: &str) -> String {
    root.ok(&["exec", name, "--", "cat", "/var/lib/nestbox/mark"])
        .trim()
        .to_string()
}

/// `rm -f` the (top-level) boxes `names` and check that nothing of them is
/// left: no process of their cgroup subtrees, no cgroup, no mount, no row.
fn rm_all_leaves_nothing(root: &TestRoot, names: &[&str]) {
    let dirs: Vec<PathBuf> = names.iter().flat_map(|b| subtree_of(root, b)).collect();
    let pids = procs_in(&dirs);
    assert!(pids.len() >= 2 * names.len(), "{pids:?}");
    root.rm_all(names.iter().copied());
    wait_for(
        "every process of the boxes to end",
        Duration::from_secs(10),
        || pids.iter().all(|p| !pid_alive(*p)),
    );
    let left: Vec<&PathBuf> = dirs.iter().filter(|d| d.exists()).collect();
    assert!(left.is_empty(), "cgroups left: {left:?}");
    assert!(mounts_under(root.path()).is_empty());
    assert!(tree(root, true).is_empty());
}

/// A nest box whose command is a warmed server, with no box inside, is frozen
/// and cloned from the host: each clone continues the server's state, is a
/// nest box of its own (a nestbox inside runs, lists and removes boxes in
/// it, in cgroups below the clone's, unseen by its siblings), and starts
/// with a copy of the template's state directory that it then changes alone.
/// A nest box with a template inside is refused (and goes on running); a
/// clone is frozen and cloned in turn; removing them all leaves nothing.
#[test]
fn a_nest_box_with_no_box_inside_is_frozen_and_cloned_and_each_clone_nests() {
    let Some(root) =
        TestRoot::new("a_nest_box_with_no_box_inside_is_frozen_and_cloned_and_each_clone_nests")
    else {
        return;
    };
    nest_server(&root, "w1");
    for i in 1..=3 {
        assert_eq!(get_inside(&root, &[], "w1"), (i, "w1".to_string()));
    }
    // The nestbox inside is used (its state directory filled) and keeps a
    // file of the user's there.
    let out = root
        .run_timeout(
            &inside(&["w1"], &["run", "--rm", "--", "echo", "warm"]),
            START,
        )
        .ok();
    assert_eq!(out.stdout.trim(), "warm", "{out}");
    set_mark(&root, "w1", "template");
    // With a box inside, it is refused, and goes on as it was.
    refused_with_a_template_inside(&root, "w1", &["freeze", "w1", "--as", "t1"], 4);
    let out = root.run(&["freeze", "w1", "--as", "t1"]).ok();
    assert_eq!(out.stdout.trim(), "t1", "{out}");

    for c in ["c1", "c2"] {
        let out = root
            .run_timeout(&["clone", "t1", "-d", "--name", c], START)
            .ok();
        assert_eq!(out.stdout.trim(), c, "{out}");
        // The server continues from the template's count.
        assert_eq!(get_inside(&root, &[], c), (5, c.to_string()));
    }
    // Each clone nests on its own.
    start(&root, &["c1"], "in1", &[]);
    assert_eq!(names_inside(&root, &["c1"], true), ["in1"]);
    assert!(names_inside(&root, &["c2"], true).is_empty());
    let rows = tree(&root, false);
    assert!(
        row(&rows, "c1/in1").is_some() && row(&rows, "c2/in1").is_none(),
        "{rows:?}"
    );
    // in1's processes are in cgroups below c1's.
    let c1_dirs = box_dirs(&root, "c1");
    let in1 = host_pid(&root, "c1/in1");
    let below: Vec<i32> = procs_in(
        &subtree_of(&root, "c1")
            .into_iter()
            .filter(|d| !c1_dirs.contains(d))
            .collect::<Vec<_>>(),
    );
    assert!(below.contains(&in1), "{in1} in {below:?}");
    let out = root
        .run_timeout(
            &inside(&["c2"], &["run", "--rm", "--", "sh", "-c", "echo from-c2"]),
            START,
        )
        .ok();
    assert_eq!(out.stdout.trim(), "from-c2", "{out}");
    // The state directory: the template's copy, then each clone's own.
    let mark = |b: &str| mark_of(&root, b);
    assert_eq!(mark("c1"), "template");
    set_mark(&root, "c1", "c1");
    assert_eq!(mark("c1"), "c1");
    assert_eq!(mark("c2"), "template");
    let w1_id = root.inspect("w1")["state"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let w1_mark = root.path().join(format!("lib/boxes/{w1_id}/nest/mark"));
    assert_eq!(
        std::fs::read_to_string(&w1_mark).unwrap().trim(),
        "template",
        "the template's is untouched"
    );
    // A clone is a template in turn (its box inside removed first: a nest
    // box saved with its boxes is `a_nest_box_is_saved_with_its_boxes_…`).
    root.run(&inside(&["c1"], &["rm", "-f", "in1"])).ok();
    root.run(&["freeze", "c1", "--as", "t2"]).ok();
    let out = root
        .run_timeout(&["clone", "t2", "-d", "--name", "g1"], START)
        .ok();
    assert_eq!(out.stdout.trim(), "g1", "{out}");
    assert_eq!(get_inside(&root, &[], "g1"), (6, "g1".to_string()));
    assert_eq!(mark("g1"), "c1");
    start(&root, &["g1"], "in3", &[]);
    assert_eq!(names_inside(&root, &["g1"], false), ["in3"]);
    // All removed: nothing left.
    rm_all_leaves_nothing(&root, &["g1", "c2", "c1", "w1"]);
}

/// A nest box whose command is a warmed server, with no box inside, is
/// checkpointed and restored twice after the original is gone: each restored
/// box continues the server's count, is a nest box of its own (boxes run in
/// it, in cgroups below its own), and starts with the checkpoint's copy of
/// the state directory; a checkpoint with a template inside is refused and
/// the box goes on running. One restored box migrates to another root
/// (another host) and goes on there as a nest box, state directory
/// included; one with a template inside is refused. Removing everything
/// leaves nothing.
#[test]
fn an_idle_nest_box_is_checkpointed_restored_and_migrated_as_a_nest_box() {
    let Some(root) =
        TestRoot::new("an_idle_nest_box_is_checkpointed_restored_and_migrated_as_a_nest_box")
    else {
        return;
    };
    nest_server(&root, "w1");
    for i in 1..=2 {
        assert_eq!(get_inside(&root, &[], "w1"), (i, "w1".to_string()));
    }
    set_mark(&root, "w1", "saved");
    refused_with_a_template_inside(&root, "w1", &["checkpoint", "w1", "--as", "k1"], 3);
    let out = root.run(&["checkpoint", "w1", "--as", "k1"]).ok();
    assert!(out.stdout.contains("k1"), "{out}");
    // Stopped by its checkpoint, then removed: the restore needs neither.
    root.rm_all(["w1"]);
    for r in ["r1", "r2"] {
        let out = root
            .run_timeout(&["restore", "k1", "--name", r, "-d"], START)
            .ok();
        assert!(out.stdout.contains(r), "{out}");
        // The hostname is the checkpointed box's; the count goes on.
        assert_eq!(get_inside(&root, &[], r), (4, "w1".to_string()));
        assert_eq!(mark_of(&root, r), "saved");
    }
    start(&root, &["r1"], "in1", &[]);
    assert_eq!(names_inside(&root, &["r1"], true), ["in1"]);
    assert!(names_inside(&root, &["r2"], true).is_empty());
    let r1_dirs = box_dirs(&root, "r1");
    let in1 = host_pid(&root, "r1/in1");
    let below = procs_in(
        &subtree_of(&root, "r1")
            .into_iter()
            .filter(|d| !r1_dirs.contains(d))
            .collect::<Vec<_>>(),
    );
    assert!(below.contains(&in1), "{in1} in {below:?}");
    set_mark(&root, "r1", "r1");
    assert_eq!(
        mark_of(&root, "r2"),
        "saved",
        "each restored box has its own copy"
    );

    // Migrated to another root (standing for another host): refused with a
    // template inside, the box running on; without, it continues there as a
    // nest box, its state directory with it.
    let there =
        TestRoot::new("an_idle_nest_box_is_checkpointed_restored_and_migrated_as_a_nest_box-there")
            .expect("a second root");
    let receive = format!(
        "exec:{NESTBOX} --root {} receive --stdio",
        there.path().display()
    );
    root.run(&inside(&["r1"], &["freeze", "in1"])).ok();
    assert_error(
        &root.run(&["migrate", "r1", "--to", &receive]),
        125,
        "box \"r1\" could not suspend the boxes inside it: box \"in1\" is a template",
    );
    assert_eq!(root.status("r1").as_deref(), Some("running"));
    assert_eq!(get_inside(&root, &[], "r1"), (5, "w1".to_string()));
    set_mark(&root, "r2", "r2");
    root.run_timeout(&["migrate", "r2", "--to", &receive], START)
        .ok();
    assert_eq!(root.status("r2"), None, "gone from here");
    assert_eq!(get_inside(&there, &[], "r2"), (5, "w1".to_string()));
    assert_eq!(
        mark_of(&there, "r2"),
        "r2",
        "its state directory went with it"
    );
    start(&there, &["r2"], "in2", &[]);
    assert_eq!(names_inside(&there, &["r2"], false), ["in2"]);
    there.rm_all(["r2"]);
    assert!(tree(&there, true).is_empty());

    rm_all_leaves_nothing(&root, &["r1"]);
    root.ok(&["checkpoint", "rm", "k1"]);
}

/// Checkpoint and restore work inside a nest box as on a host (the box's
/// processes there have the nest box's seccomp filter under their own,
/// which a restore made inside inherits again), and so does a snapshot with
/// its processes and the rollback to it.
#[test]
fn checkpoint_restore_and_rollback_with_processes_work_inside_a_nest_box() {
    let Some(root) =
        TestRoot::new("checkpoint_restore_and_rollback_with_processes_work_inside_a_nest_box")
    else {
        return;
    };
    start(&root, &[], "n", &["--nest"]);
    warmed_server_inside(&root, &["n"], "s", 2);
    let out = root
        .run_timeout(
            &inside(
                &["n"],
                &["checkpoint", "s", "--as", "sc", "--leave-running"],
            ),
            START,
        )
        .ok();
    assert_eq!(out.stdout.trim(), "sc", "{out}");
    let out = root
        .run_timeout(&inside(&["n"], &["restore", "sc", "--name", "r"]), START)
        .ok();
    assert_eq!(out.stdout.trim(), "r", "{out}");
    assert_eq!(
        get_inside(&root, &["n"], "r").0,
        3,
        "the restored box continues"
    );
    assert_eq!(get_inside(&root, &["n"], "s").0, 3, "the box ran on");
    let out = root
        .run_timeout(
            &inside(&["n"], &["snapshot", "s", "k", "--checkpoint"]),
            START,
        )
        .ok();
    assert!(out.stdout.contains("processes checkpointed"), "{out}");
    assert_eq!(get_inside(&root, &["n"], "s").0, 4);
    assert_eq!(get_inside(&root, &["n"], "s").0, 5);
    root.run_timeout(&inside(&["n"], &["rollback", "s", "k"]), START)
        .ok();
    assert_eq!(
        get_inside(&root, &["n"], "s").0,
        4,
        "back to the snapshot's 3"
    );
    root.run(&inside(&["n"], &["rm", "-f", "r", "s"])).ok();
    root.run(&inside(&["n"], &["checkpoint", "rm", "sc"])).ok();
    root.run(&["rm", "-f", "n"]).ok();
    root.assert_no_boxes();
}

/// A nest box is saved with the boxes inside it, three levels deep: the
/// counter server `w1` on the host runs the nest box `n2`, itself a counter
/// server, which runs the counter server `s`. Each save suspends the boxes
/// inside (each saved with its processes and stopped, deepest first), and
/// wherever the nest box runs again they run again, their counts going on:
/// after `checkpoint --leave-running` in `w1` itself; in two boxes restored
/// from a checkpoint that stopped it, after it is removed; in two clones of
/// one of those frozen with a pool (one claimed from it) and in one cloned
/// through the API (`serve`); in one moved to another root (another host). Each box
/// inside keeps its name, its hostname and its place (`ps --tree`), and
/// each copy's are its own. Removing everything leaves nothing.
#[test]
fn a_nest_box_is_saved_with_its_boxes_three_levels_deep() {
    let Some(root) = TestRoot::new("a_nest_box_is_saved_with_its_boxes_three_levels_deep") else {
        return;
    };
    nest_server(&root, "w1");
    let args = [
        "run",
        "-d",
        "--name",
        "n2",
        "--nest",
        "--",
        "python3",
        "-c",
        common::apps::PYTHON_POOL_SERVER,
    ];
    let out = root.run_timeout(&inside(&["w1"], &args), START).ok();
    assert_eq!(out.stdout.trim(), "n2", "{out}");
    warmed_server_inside(&root, &["w1", "n2"], "s", 2);
    assert_eq!(get_inside(&root, &[], "w1"), (1, "w1".to_string()));
    assert_eq!(get_inside(&root, &["w1"], "n2"), (1, "n2".to_string()));
    // The three counts of the subtree of top-level box `top`.
    let counts = |top: &str| {
        (
            get_inside(&root, &[], top).0,
            get_inside(&root, &[top], "n2"),
            get_inside(&root, &[top, "n2"], "s"),
        )
    };
    let running = |top: &str| {
        let rows = tree(&root, false);
        for name in [top.to_string(), format!("{top}/n2"), format!("{top}/n2/s")] {
            assert_eq!(
                row(&rows, &name).map(|r| r["status"].clone()),
                Some(Value::from("running")),
                "{name} in {rows:?}"
            );
        }
    };

    // A save killed once the boxes inside were suspended leaves them
    // stopped, each with its processes kept: `gc` runs them again.
    root.run(&inside(&["w1"], &["subtree", "suspend"])).ok();
    assert!(names_inside(&root, &["w1"], false).is_empty());
    let out = root.run(&["gc"]).ok();
    assert!(
        out.stdout
            .contains("w1: boxes left suspended inside resumed"),
        "{out}"
    );
    running("w1");
    assert_eq!(
        counts("w1"),
        (2, (2, "n2".to_string()), (3, "s".to_string()))
    );

    // Left running: the boxes inside go on from where they were.
    let out = root
        .run_timeout(
            &["checkpoint", "w1", "--as", "k1", "--leave-running"],
            START,
        )
        .ok();
    assert!(out.stdout.contains("k1"), "{out}");
    running("w1");
    assert_eq!(
        counts("w1"),
        (3, (3, "n2".to_string()), (4, "s".to_string()))
    );

    // Stopped by a checkpoint, removed, restored twice.
    let out = root
        .run_timeout(&["checkpoint", "w1", "--as", "k2"], START)
        .ok();
    assert!(out.stdout.contains("k2"), "{out}");
    assert_ne!(root.status("w1").as_deref(), Some("running"));
    root.rm_all(["w1"]);
    for r in ["r1", "r2"] {
        let out = root
            .run_timeout(&["restore", "k2", "--name", r, "-d"], START)
            .ok();
        assert!(out.stdout.contains(r), "{out}");
        running(r);
    }
    assert_eq!(
        counts("r1"),
        (4, (4, "n2".to_string()), (5, "s".to_string()))
    );
    assert_eq!(
        counts("r2"),
        (4, (4, "n2".to_string()), (5, "s".to_string())),
        "each restored box's subtree is its own"
    );

    // Frozen (its boxes inside suspended) with a pool, and cloned: each
    // clone, claimed from the pool or forked, runs them.
    let out = root
        .run_timeout(&["freeze", "r1", "--as", "t1", "--pool", "1"], START)
        .ok();
    assert_eq!(out.stdout.trim(), "t1", "{out}");
    assert_eq!(template_inside(&root, &[], "t1")["pooled"], 1);
    for c in ["c1", "c2"] {
        let out = root
            .run_timeout(&["clone", "t1", "-d", "--name", c], START)
            .ok();
        assert_eq!(out.stdout.trim(), c, "{out}");
        running(c);
        assert_eq!(counts(c), (5, (5, "n2".to_string()), (6, "s".to_string())));
    }

    // And through the API (`nestbox serve`).
    let socket = root.path().join("api.sock");
    let mut server = root.spawn(&["serve", "--socket", socket.to_str().unwrap()]);
    wait_for("the socket", Duration::from_secs(20), || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    let answer = ApiClient::connect(&socket).call(r#"{"op":"clone","template":"t1","name":"c3"}"#);
    assert_eq!(answer["ok"], true, "{answer}");
    running("c3");
    assert_eq!(
        counts("c3"),
        (5, (5, "n2".to_string()), (6, "s".to_string()))
    );
    // SAFETY: kill has no memory-safety preconditions; the pid is our child's.
    unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
    assert!(server.wait().unwrap().success());

    // Moved to another root (standing for another host).
    let there = TestRoot::new("a_nest_box_is_saved_with_its_boxes_three_levels_deep-there")
        .expect("a second root");
    let receive = format!(
        "exec:{NESTBOX} --root {} receive --stdio",
        there.path().display()
    );
    root.run_timeout(&["migrate", "r2", "--to", &receive], START)
        .ok();
    assert_eq!(root.status("r2"), None, "gone from here");
    let rows = tree(&there, false);
    assert!(
        ["r2", "r2/n2", "r2/n2/s"]
            .iter()
            .all(|n| row(&rows, n).is_some_and(|r| r["status"] == "running")),
        "{rows:?}"
    );
    assert_eq!(get_inside(&there, &["r2", "n2"], "s"), (6, "s".to_string()));
    assert_eq!(get_inside(&there, &["r2"], "n2"), (5, "n2".to_string()));
    there.rm_all(["r2"]);
    assert!(tree(&there, true).is_empty());

    rm_all_leaves_nothing(&root, &["c1", "c2", "c3", "r1"]);
    root.ok(&["checkpoint", "rm", "k1"]);
    root.ok(&["checkpoint", "rm", "k2"]);
}
