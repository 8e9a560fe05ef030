//! The pool of box shells (`nestbox pool`): a box started from a shell made
//! ahead is, from inside and from every command, the box a cold start makes;
//! only a request of a shell's exact shape takes one; concurrent requests
//! each get their own; killing the CLI mid-claim or a shell's monitor leaves
//! nothing after `gc`; removing the network or draining the pool removes the
//! shells.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use serde_json::Value;

const START: Duration = Duration::from_secs(20);

/// The state records of the shells ready in `root`'s pool.
fn shell_states(root: &TestRoot) -> Vec<Value> {
    std::fs::read_dir(root.path().join("run/boxes"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("pool.shell."))
        .filter_map(|e| std::fs::read_to_string(e.path().join("state.json")).ok())
        .filter_map(|s| serde_json::from_str::<Value>(&s).ok())
        .collect()
}

/// The ids of the shells ready in `root`'s pool (read from their records).
fn shell_ids(root: &TestRoot) -> BTreeSet<String> {
    shell_states(root)
        .iter()
        .filter_map(|v| v["id"].as_str().map(String::from))
        .collect()
}

/// The monitor pids of the ready shells of `root`.
fn shell_monitors(root: &TestRoot) -> Vec<i32> {
    shell_states(root)
        .iter()
        .filter_map(|v| v["monitor"]["pid"].as_i64().map(|p| p as i32))
        .collect()
}

/// `pool ls --json`.
fn pool(root: &TestRoot) -> Value {
    let out = root.run(&["pool", "ls", "--json"]).ok();
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("pool ls: {e}\n{out}"))
}

/// Shells ready of the shape whose network is `network` ("bridge", "none").
fn ready(root: &TestRoot, network: &str) -> u64 {
    pool(root)["shapes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["shape"]["network"] == network)
        .map(|s| s["ready"].as_u64().unwrap_or(0))
        .sum()
}

/// Wait until `n` shells of `network`'s shape are ready.
#[track_caller]
fn wait_ready(root: &TestRoot, network: &str, n: u64) {
    wait_for(
        &format!("{n} {network} shell(s) ready"),
        Duration::from_secs(30),
        || ready(root, network) >= n,
    );
}

/// What a box sees of itself: identity, namespaces, root, limits, caps.
const SELF_REPORT: &str = "echo pid=$$; echo host=$(hostname); echo env=$HOSTNAME; \
    echo init=$(tr '\\0' ' ' </proc/1/cmdline); \
    echo eth=$(ip -4 -o addr show eth0 2>/dev/null | wc -l); \
    echo lo=$(cat /sys/class/net/lo/operstate); \
    echo root=$(ls / | tr '\\n' ' '); echo id=$(id); echo cwd=$(pwd); \
    echo caps=$(grep CapEff /proc/self/status); \
    echo seccomp=$(grep Seccomp: /proc/self/status); \
    echo first=$(ls /proc | grep '^[0-9]' | sort -n | head -1); \
    echo mask=$(umask) nofile=$(ulimit -n) nice=$(nice); \
    echo nns=$(readlink /proc/self/ns/net) uns=$(readlink /proc/self/ns/uts) \
    pns=$(readlink /proc/self/ns/pid) mns=$(readlink /proc/self/ns/mnt)";

/// `nestbox run OPTS -- sh -c SCRIPT` from a process with umask 027, at most
/// 777 open files and nice 3, which a box's command inherits.
fn sh_inheriting(root: &TestRoot, opts: &[&str], script: &str) -> Out {
    use std::os::unix::process::CommandExt;
    let mut args = vec!["run"];
    args.extend_from_slice(opts);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    let mut cmd = root.command(&args);
    // SAFETY: only async-signal-safe calls (umask, setrlimit, nice) between
    // fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::umask(0o027);
            let l = libc::rlimit {
                rlim_cur: 777,
                rlim_max: 777,
            };
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
            libc::nice(3);
            Ok(())
        });
    }
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = cmd.spawn().expect("spawn nestbox");
    finish(child, None, START, format!("nestbox {}", args.join(" ")))
}

fn field<'a>(report: &'a str, key: &str) -> &'a str {
    report
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in {report:?}"))
}

#[test]
fn a_pooled_run_is_from_inside_and_outside_what_a_cold_run_is() {
    let Some(root) = TestRoot::new("a_pooled_run_is_from_inside_and_outside_what_a_cold_run_is")
    else {
        return;
    };
    // A cold run first (no pool), then the same request from the pool.
    let cold = sh_inheriting(
        &root,
        &["--name", "sp-cold", "--pids", "50", "-e", "X=1"],
        SELF_REPORT,
    )
    .ok();
    root.run(&["pool", "size", "2"]).ok();
    // The shape of --pids 50 is learned from that request on: asked for once
    // more, it is made; the next request takes a shell. (Both of its shells
    // ready and none being made: a shell made after the list below was
    // taken could be the one claimed.)
    root.run(&["run", "--rm", "--pids", "50", "--", "true"])
        .ok();
    wait_for("the --pids 50 shells", Duration::from_secs(30), || {
        pool(&root)["shapes"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|s| {
                s["shape"]["limits"]["pids"] == 50
                    && s["ready"].as_u64() == Some(2)
                    && s["making"].as_u64() == Some(0)
            })
    });
    let shells = shell_ids(&root);
    let warm = sh_inheriting(
        &root,
        &["--name", "sp-warm", "--pids", "50", "-e", "X=1"],
        SELF_REPORT,
    )
    .ok();
    let v = root.inspect("sp-warm");
    let id = v["id"].as_str().unwrap();
    assert!(
        shells.contains(id),
        "the box did not come from the pool ({id} not in {shells:?})"
    );
    let host_ns = |ns: &str| std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap();
    for (what, report) in [("cold", &cold.stdout), ("pooled", &warm.stdout)] {
        assert_eq!(
            field(report, "pid"),
            "2",
            "{what}: the command is pid 2\n{report}"
        );
        assert_eq!(field(report, "init"), "nestbox-init", "{what}\n{report}");
        assert_eq!(
            field(report, "eth"),
            "1",
            "{what}: one address on eth0\n{report}"
        );
        assert_eq!(
            field(report, "first"),
            "1",
            "{what}: init is pid 1\n{report}"
        );
        for ns in ["net", "uts", "pid", "mnt"] {
            let inside = report
                .split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{}ns=", &ns[..1])))
                .unwrap();
            assert_ne!(
                inside,
                host_ns(ns).to_string_lossy(),
                "{what}: own {ns} namespace\n{report}"
            );
        }
    }
    assert_eq!(field(&warm.stdout, "host"), "sp-warm");
    assert_eq!(field(&warm.stdout, "env"), "sp-warm");
    assert_eq!(field(&cold.stdout, "host"), "sp-cold");
    // (The nice value is the caller's + 3: compared with the cold box's below.)
    assert!(
        warm.stdout.contains("mask=0027 nofile=777 nice="),
        "what the caller's process passes on\n{}",
        warm.stdout
    );
    for key in ["lo", "root", "id", "cwd", "caps", "seccomp", "mask"] {
        assert_eq!(
            field(&warm.stdout, key),
            field(&cold.stdout, key),
            "{key} differs between a pooled and a cold box"
        );
    }
    assert_ne!(field(&warm.stdout, "nns"), field(&cold.stdout, "nns"));
    // Outside: ps, inspect, logs, exit code, rm as for any box.
    assert_eq!(root.status("sp-warm").as_deref(), Some("exited"));
    assert_eq!(v["exit_code"], 0);
    assert_eq!(v["limits"]["pids"], 50);
    assert_eq!(v["spec"]["limits"]["pids"], 50);
    assert_eq!(v["spec"]["command"][0], "sh");
    assert_eq!(v["spec"]["env"][0], "X=1");
    assert!(v["state"]["network"]["names"]
        .as_array()
        .is_some_and(|n| n.iter().any(|x| x == "sp-warm")));
    let log = root.ok(&["logs", "sp-warm"]);
    assert!(log.contains("host=sp-warm"), "{log}");
    root.run(&["rm", "sp-warm", "sp-cold"]).ok();
    assert!(root.names().is_empty());

    // Exit codes, output, stdin, a taken name, a missing command, --rm.
    wait_ready(&root, "bridge", 2);
    let out = root.sh(&["--rm"], "echo out; echo err >&2; exit 7").code(7);
    assert_eq!(
        (out.stdout.as_str(), out.stderr.as_str()),
        ("out\n", "err\n")
    );
    let echoed = root.run_with_stdin(&["run", "--rm", "-i", "--", "cat"], b"through\n");
    assert_eq!(echoed.ok().stdout, "through\n");
    wait_ready(&root, "bridge", 1);
    root.detached_sh("sp-taken", &[], "sleep 60");
    wait_ready(&root, "bridge", 1);
    let before = shell_ids(&root);
    let out = root.run(&["run", "--name", "sp-taken", "--", "true"]);
    assert_error(&out, 125, "already exists");
    // (A refill still under way may add a shell meanwhile: the ones that
    // were ready must all still be there.)
    let after = shell_ids(&root);
    assert!(
        before.is_subset(&after),
        "a refused claim keeps its shell: {before:?} before, {after:?} after"
    );
    let out = root.run(&[
        "run",
        "--name",
        "sp-missing",
        "--",
        "nestbox-no-such-command",
    ]);
    assert_error(&out, 127, "not found");
    assert!(
        root.row("sp-missing").is_none(),
        "a failed start leaves no box"
    );
    // Signals reach the command; --rm leaves nothing.
    wait_ready(&root, "bridge", 1);
    let out = sigterm_to_a_foreground_run(&root, &["--rm", "--name", "sp-term"]);
    assert_eq!(out.code, 9, "SIGTERM must reach the command\n{out}");
    assert!(root.row("sp-term").is_none(), "--rm left the box");
    root.run(&["rm", "-f", "sp-taken"]).ok();
    assert!(root.names().is_empty());
}

#[test]
fn a_request_of_another_shape_takes_the_cold_path() {
    let Some(root) = TestRoot::new("a_request_of_another_shape_takes_the_cold_path") else {
        return;
    };
    root.run(&["pool", "size", "1"]).ok();
    wait_ready(&root, "bridge", 1);
    let shells = shell_ids(&root);
    // Another network, limits, a volume, a read-only root: none is a default shell.
    let dir = tempfile::tempdir().unwrap();
    let vol = format!("{}:/data", dir.path().display());
    let cases: Vec<Vec<&str>> = vec![
        vec!["--network", "none"],
        vec!["--memory", "64m"],
        vec!["-v", &vol],
        vec!["--read-only"],
        vec!["--tmpfs", "/scratch"],
    ];
    for (i, opts) in cases.iter().enumerate() {
        let name = format!("sp-other-{i}");
        let mut args = vec!["run", "--name", &name];
        args.extend(opts.iter().copied());
        args.extend(["--", "true"]);
        root.run(&args).ok();
        let id = root.inspect(&name)["id"].as_str().unwrap().to_string();
        assert!(!shells.contains(&id), "{opts:?} took a default shell");
        root.run(&["rm", &name]).ok();
    }
    assert!(
        shells.is_subset(&shell_ids(&root)),
        "the default shell was left alone"
    );
    // The shapes asked for are learned (a volume's is never pooled).
    wait_for("the learned shapes", Duration::from_secs(30), || {
        pool(&root)["shapes"].as_array().map(|a| a.len()) == Some(5)
    });
}

#[test]
fn concurrent_runs_each_get_their_own_shell() {
    let Some(root) = TestRoot::new("concurrent_runs_each_get_their_own_shell") else {
        return;
    };
    root.run(&["pool", "size", "3"]).ok();
    wait_ready(&root, "bridge", 3);
    let shells = shell_ids(&root);
    // More callers than shells, all at once: each box is a shell or cold,
    // never one shell twice.
    let outs: Vec<(String, Out)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8)
            .map(|i| {
                let root = &root;
                s.spawn(move || {
                    let name = format!("sp-many-{i}");
                    let out = root.sh(&["--name", &name], "hostname; sleep 0.5");
                    (name, out)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut ids = BTreeSet::new();
    let mut pooled = 0;
    for (name, out) in &outs {
        let out = out.clone().ok();
        assert_eq!(out.stdout.trim(), name);
        let id = root.inspect(name)["id"].as_str().unwrap().to_string();
        pooled += usize::from(shells.contains(&id));
        assert!(ids.insert(id), "two boxes with one id");
    }
    assert!(pooled >= 1, "no run took a shell");
    assert!(pooled <= 3);
    let names: Vec<&str> = outs.iter().map(|(n, _)| n.as_str()).collect();
    root.rm_all(names);
}

#[test]
fn killing_the_cli_mid_claim_or_a_shells_monitor_leaves_nothing_after_gc() {
    let Some(root) =
        TestRoot::new("killing_the_cli_mid_claim_or_a_shells_monitor_leaves_nothing_after_gc")
    else {
        return;
    };
    root.run(&["pool", "size", "2"]).ok();
    // The CLI killed at points all along the claim, and once the box runs.
    for (i, delay_us) in [0u64, 300, 700, 1500, 3000, 6000, 20_000]
        .iter()
        .enumerate()
    {
        wait_ready(&root, "bridge", 1);
        let name = format!("sp-kill-{i}");
        let mut child = root.spawn(&["run", "--name", &name, "--", "sleep", "30"]);
        std::thread::sleep(Duration::from_micros(*delay_us));
        // SAFETY: kill has no memory-safety preconditions; our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        let _ = child.wait();
        // The box, if it was made, ends with its caller.
        wait_for(&format!("{name} to be gone or dead"), START, || {
            root.row(&name).is_none_or(|r| r["status"] == "dead")
        });
    }
    // A ready shell's monitor killed: its init goes with it.
    wait_ready(&root, "bridge", 2);
    let monitors = shell_monitors(&root);
    assert!(!monitors.is_empty());
    // SAFETY: as above; the pid is a shell's monitor.
    assert_eq!(unsafe { libc::kill(monitors[0], libc::SIGKILL) }, 0);
    // A claimed box's monitor killed.
    wait_ready(&root, "bridge", 1);
    root.detached_sh("sp-orphan", &[], "sleep 60");
    let m = root.inspect("sp-orphan")["state"]["monitor_pid"]
        .as_i64()
        .unwrap() as i32;
    // SAFETY: as above; the pid is the box's monitor.
    assert_eq!(unsafe { libc::kill(m, libc::SIGKILL) }, 0);
    wait_for("sp-orphan dead", START, || {
        root.status("sp-orphan").as_deref() == Some("dead")
    });
    root.run(&["gc"]).ok();
    assert!(root.names().is_empty(), "gc left boxes: {:?}", root.names());
    // Only live shells are left (the pool refills): none after a drain.
    root.run(&["pool", "drain"]).ok();
    root.assert_no_boxes();
    for p in monitors {
        wait_for("the shell monitors to end", START, || !pid_alive(p));
    }
}

#[test]
fn the_pool_is_drained_with_the_network_and_by_pool_drain() {
    let Some(root) = TestRoot::new("the_pool_is_drained_with_the_network_and_by_pool_drain") else {
        return;
    };
    root.run(&["pool", "size", "2"]).ok();
    root.run(&["run", "--rm", "--network", "none", "--", "true"])
        .ok();
    wait_ready(&root, "bridge", 2);
    wait_ready(&root, "none", 2);
    let monitors = shell_monitors(&root);
    assert_eq!(monitors.len(), 4);
    // The network cannot go with boxes on it: its shells go first.
    root.run(&["network", "rm"]).ok();
    assert_eq!(ready(&root, "bridge"), 0);
    assert_eq!(ready(&root, "none"), 2, "shells of --network none stay");
    // size 0 drains the rest and keeps the pool off.
    root.run(&["pool", "size", "0"]).ok();
    root.run(&["run", "--rm", "--network", "none", "--", "true"])
        .ok();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(pool(&root)["shapes"], serde_json::json!([]));
    root.assert_no_boxes();
    for p in monitors {
        wait_for("the shell monitors to end", START, || !pid_alive(p));
    }
    assert!(
        root.all_cgroup_dirs().is_empty(),
        "{:?}",
        root.all_cgroup_dirs()
    );
}

/// Host pids of the live processes whose command line is `argv`.
fn host_processes_running(argv: &[&str]) -> Vec<i32> {
    let want = argv.join("\0") + "\0";
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|p| std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| c == want.as_bytes()))
        .collect()
}

/// The parent of host process `pid`.
fn parent_of(pid: i32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    rest.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn when_run_returns_no_process_of_its_box_is_left() {
    let Some(root) = TestRoot::new("when_run_returns_no_process_of_its_box_is_left") else {
        return;
    };
    let background = ["sleep", "31337"];
    let entered = ["sleep", "31338"];
    for pooled in [true, false] {
        root.run(&["pool", "size", if pooled { "2" } else { "0" }])
            .ok();
        if pooled {
            wait_ready(&root, "bridge", 2);
        }
        let shells = shell_ids(&root);
        // The command leaves a process in the background, and a process is
        // entered into the box from outside (`exec`) while it runs: both
        // are killed when the box ends, and `run` returns only once they
        // are gone. The entered one's parent is outside (the `exec`
        // helper, which reaps it): stopped, it cannot reap it, and `run`
        // must wait.
        let mut run = root.spawn(&[
            "run",
            "--rm",
            "--name",
            "sp-end",
            "--",
            "sh",
            "-c",
            "sleep 31337 & while [ ! -e /tmp/go ]; do sleep 0.02; done; exit 3",
        ]);
        wait_for("the box to run", START, || {
            root.status("sp-end").as_deref() == Some("running")
        });
        let mut exec = root.spawn(&["exec", "sp-end", "--", "sleep", "31338"]);
        let mut pid = None;
        wait_for("the entered process", START, || {
            pid = host_processes_running(&entered).first().copied();
            pid.is_some()
        });
        let pid = pid.unwrap();
        let helper = nix::unistd::Pid::from_raw(parent_of(pid));
        nix::sys::signal::kill(helper, nix::sys::signal::Signal::SIGSTOP).unwrap();
        root.ok(&["exec", "sp-end", "--", "touch", "/tmp/go"]);
        std::thread::sleep(Duration::from_millis(500));
        let early = run.try_wait().unwrap();
        nix::sys::signal::kill(helper, nix::sys::signal::Signal::SIGCONT).unwrap();
        assert!(
            early.is_none(),
            "pooled {pooled}: run returned ({early:?}) while a process of its box was not reaped"
        );
        let status = run.wait().unwrap();
        let left_background = host_processes_running(&background);
        assert_eq!(status.code(), Some(3), "pooled {pooled}");
        assert!(
            left_background.is_empty() && !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "pooled {pooled}: run returned while processes of its box were left: \
             background {left_background:?}, entered {pid}"
        );
        let _ = exec.wait();
        if pooled {
            let now = shell_ids(&root);
            assert!(
                !now.is_superset(&shells),
                "pooled run: no shell was claimed ({shells:?} before, {now:?} after)"
            );
        }
        // `--rm`: gone from the listing when `run` returns.
        assert!(
            root.names().is_empty(),
            "pooled {pooled}: {:?}",
            root.names()
        );
    }
}
