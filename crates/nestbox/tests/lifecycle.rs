//! The life of a box: exit codes, output and input, detached boxes with ps,
//! inspect and logs, exec, stop, kill, signals, rm and --rm, many boxes at once,
//! and a box whose monitor died being collected by gc.

mod common;

use std::time::{Duration, Instant};

use common::*;

const START: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------- exit codes and output

#[test]
fn successful_command_exits_0() {
    let Some(root) = TestRoot::new("successful_command_exits_0") else {
        return;
    };
    root.run(&["run", "--", "true"]).code(0);
}

#[test]
fn exit_code_is_the_commands_own() {
    let Some(root) = TestRoot::new("exit_code_is_the_commands_own") else {
        return;
    };
    root.sh(&[], "exit 3").code(3);
}

#[test]
fn command_not_found_exits_127() {
    let Some(root) = TestRoot::new("command_not_found_exits_127") else {
        return;
    };
    root.run(&["run", "--", "nestbox-no-such-command"])
        .code(127);
}

#[test]
fn non_executable_command_exits_126() {
    let Some(root) = TestRoot::new("non_executable_command_exits_126") else {
        return;
    };
    root.run(&["run", "--", "/etc/passwd"]).code(126);
}

#[test]
fn command_killed_by_signal_n_exits_128_plus_n() {
    let Some(root) = TestRoot::new("command_killed_by_signal_n_exits_128_plus_n") else {
        return;
    };
    root.sh(&[], "kill -9 $$").code(137);
    root.sh(&[], "kill -TERM $$").code(143);
}

#[test]
fn output_goes_to_stdout_and_stderr() {
    let Some(root) = TestRoot::new("output_goes_to_stdout_and_stderr") else {
        return;
    };
    let out = root.sh(&[], "echo out; echo err >&2").ok();
    assert_eq!(out.stdout, "out\n", "{out}");
    assert_eq!(out.stderr, "err\n", "{out}");
}

#[test]
fn interactive_passes_stdin() {
    let Some(root) = TestRoot::new("interactive_passes_stdin") else {
        return;
    };
    let out = root
        .run_with_stdin(&["run", "-i", "--", "cat"], b"hello\nworld\n")
        .ok();
    assert_eq!(out.stdout, "hello\nworld\n", "{out}");
}

#[test]
fn stdin_is_empty_without_interactive() {
    let Some(root) = TestRoot::new("stdin_is_empty_without_interactive") else {
        return;
    };
    let out = root
        .run_with_stdin(&["run", "--", "cat"], b"should not arrive\n")
        .ok();
    assert_eq!(out.stdout, "", "{out}");
}

// ---------------------------------------------------------------- detached boxes, ps, inspect, logs

#[test]
fn detached_run_prints_the_name_and_ps_lists_it() {
    let Some(root) = TestRoot::new("detached_run_prints_the_name_and_ps_lists_it") else {
        return;
    };
    root.detached_sh("lc-detached", &[], "sleep 60");
    let row = root.row("lc-detached").expect("ps -a lists the box");
    assert_eq!(row["status"], "running", "{row}");
    assert!(row["pid"].as_i64().is_some_and(|p| p > 0), "{row}");
    let table = root.ok(&["ps"]);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("lc-detached") && l.contains("running")),
        "ps table:\n{table}"
    );
}

#[test]
fn a_box_idle_long_enough_for_its_monitor_and_init_to_shed_memory_still_works() {
    let Some(root) = TestRoot::new("lc_idle_shed") else {
        return;
    };
    // Past the idle time after which monitor and init drop their file pages:
    // both must then still relay output, forward signals, reap and record.
    root.detached_sh(
        "lc-idle",
        &[],
        "trap 'echo got-term; exit 7' TERM; echo before; sleep 3; echo after; while :; do sleep 0.1; done",
    );
    root.wait_log("lc-idle", "after", START);
    let v = root.inspect("lc-idle");
    let init = v["state"]["init_pid"].as_i64().expect("init_pid") as i32;
    let monitor = v["state"]["monitor_pid"].as_i64().expect("monitor_pid") as i32;
    assert!(pid_alive(init) && pid_alive(monitor), "{v}");
    root.ok(&["kill", "-s", "TERM", "lc-idle"]);
    assert_eq!(root.wait_exited("lc-idle", START), 7);
    let logs = root.ok(&["logs", "lc-idle"]);
    assert!(
        logs.contains("before") && logs.contains("after") && logs.contains("got-term"),
        "{logs}"
    );
}

#[test]
fn a_detached_monitors_failure_after_start_is_in_its_log() {
    let Some(root) = TestRoot::new("a_detached_monitors_failure_after_start_is_in_its_log") else {
        return;
    };
    root.detached_sh("lc-monlog", &[], "echo ready; sleep 60");
    root.wait_log("lc-monlog", "ready", START);
    assert_eq!(
        root.ok(&["logs", "--monitor", "lc-monlog"]),
        "",
        "nothing to report yet"
    );
    let v = root.inspect("lc-monlog");
    let monitor = v["state"]["monitor_pid"].as_i64().expect("monitor_pid") as i32;
    // A directory in place of the record's lock file: the monitor cannot
    // record the box's end, after having reported the box started.
    let lock = root.path().join("run/boxes/lc-monlog/lock");
    std::fs::remove_file(&lock).unwrap();
    std::fs::create_dir(&lock).unwrap();
    root.ok(&["kill", "lc-monlog"]);
    wait_for("the monitor to end", START, || !pid_alive(monitor));
    let log = root.ok(&["logs", "--monitor", "lc-monlog"]);
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(
        lines[0].contains(" ERROR box \"lc-monlog\": open ") && lines[0].contains("/lock: "),
        "{log}"
    );
    std::fs::remove_dir(&lock).unwrap();
    std::fs::File::create(&lock).unwrap();
    root.ok(&["rm", "-f", "lc-monlog"]);
}

#[test]
fn inspect_describes_a_running_box() {
    let Some(root) = TestRoot::new("inspect_describes_a_running_box") else {
        return;
    };
    root.detached_sh("lc-inspect", &["--memory", "64m"], "echo ready; sleep 60");
    root.wait_log("lc-inspect", "ready", START);
    let v = root.inspect("lc-inspect");
    assert_eq!(v["name"], "lc-inspect");
    let id = v["id"].as_str().expect("id");
    assert!(!id.is_empty());
    assert_eq!(v["spec"]["command"][0], "sh", "{v}");
    assert_eq!(v["state"]["status"], "running", "{v}");
    let init = v["state"]["init_pid"].as_i64().expect("init_pid") as i32;
    let monitor = v["state"]["monitor_pid"].as_i64().expect("monitor_pid") as i32;
    assert!(
        pid_alive(init) && pid_alive(monitor),
        "init {init} and monitor {monitor} must run\n{v}"
    );
    let pids: Vec<i64> = v["pids"]
        .as_array()
        .expect("pids")
        .iter()
        .filter_map(|p| p.as_i64())
        .collect();
    assert!(
        pids.contains(&(init as i64)) && pids.len() >= 3,
        "pids lists init, sh and sleep: {pids:?}"
    );
    let cgroups = cgroup_paths(&v);
    assert!(!cgroups.is_empty(), "inspect shows no cgroup\n{v}");
    for (controller, dir) in &cgroups {
        assert!(
            dir.is_dir(),
            "cgroup {controller} {} does not exist",
            dir.display()
        );
        assert!(
            is_box_cgroup_name(&dir.file_name().unwrap().to_string_lossy(), id),
            "cgroup dir {} is not named after the box id",
            dir.display()
        );
    }
    assert_eq!(v["limits"]["memory"], 64 << 20, "{v}");
    assert!(v["exit_code"].is_null(), "{v}");
    assert_eq!(v["oom_killed"], false, "{v}");
}

#[test]
fn ps_lists_exited_boxes_only_with_all() {
    let Some(root) = TestRoot::new("ps_lists_exited_boxes_only_with_all") else {
        return;
    };
    root.sh(&["--name", "lc-exited"], "exit 4").code(4);
    let row = root.row("lc-exited").expect("ps -a lists the exited box");
    assert_eq!(row["status"], "exited", "{row}");
    assert_eq!(row["exit_code"], 4, "{row}");
    assert!(
        !root.ok(&["ps"]).contains("lc-exited"),
        "ps without -a lists an exited box"
    );
    assert!(root.ok(&["ps", "-a"]).contains("exited (4)"));
}

#[test]
fn logs_replay_stdout_and_stderr_separately() {
    let Some(root) = TestRoot::new("logs_replay_stdout_and_stderr_separately") else {
        return;
    };
    root.detached_sh("lc-logs", &[], "echo out1; echo err1 >&2; echo out2");
    assert_eq!(root.wait_exited("lc-logs", START), 0);
    let out = root.run(&["logs", "lc-logs"]).ok();
    assert_eq!(out.stdout, "out1\nout2\n", "{out}");
    assert_eq!(out.stderr, "err1\n", "{out}");
}

#[test]
fn logs_follow_ends_when_the_box_exits() {
    let Some(root) = TestRoot::new("logs_follow_ends_when_the_box_exits") else {
        return;
    };
    root.detached_sh("lc-follow", &[], "echo first; sleep 2; echo second");
    let started = Instant::now();
    let child = root.spawn(&["logs", "-f", "lc-follow"]);
    let out = finish(
        child,
        None,
        Duration::from_secs(20),
        "nestbox logs -f lc-follow".into(),
    )
    .ok();
    assert_eq!(
        out.stdout, "first\nsecond\n",
        "logs -f must follow until the box ends\n{out}"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "logs -f returned before the box ended"
    );
}

// ---------------------------------------------------------------- exec

#[test]
fn exec_runs_in_the_boxs_namespaces() {
    let Some(root) = TestRoot::new("exec_runs_in_the_boxs_namespaces") else {
        return;
    };
    root.detached_sh(
        "lc-exec",
        &["--hostname", "lc-exec-host"],
        "echo made-by-box > /tmp/f; echo ready; sleep 60",
    );
    root.wait_log("lc-exec", "ready", START);
    let code = "import os, socket\nprint(socket.gethostname())\nprint(open('/tmp/f').read().strip())\npids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\nprint(pids[:2], os.getpid() in pids, max(pids) < 1000)\n";
    let out = root
        .run(&["exec", "lc-exec", "--", "python3", "-c", code])
        .ok();
    assert_eq!(
        out.lines(),
        ["lc-exec-host", "made-by-box", "[1, 2] True True"],
        "{out}"
    );
}

#[test]
fn exec_returns_the_commands_exit_code() {
    let Some(root) = TestRoot::new("exec_returns_the_commands_exit_code") else {
        return;
    };
    root.detached_sh("lc-exec-code", &[], "sleep 60");
    root.run(&["exec", "lc-exec-code", "--", "sh", "-c", "exit 7"])
        .code(7);
    root.run(&["exec", "lc-exec-code", "--", "nestbox-no-such-command"])
        .code(127);
}

#[test]
fn exec_has_the_boxs_restrictions() {
    let Some(root) = TestRoot::new("exec_has_the_boxs_restrictions") else {
        return;
    };
    root.detached_sh("lc-exec-sec", &[], "sleep 60");
    let out = root
        .run(&["exec", "lc-exec-sec", "--", "cat", "/proc/self/status"])
        .ok();
    assert_eq!(cap_field(&out.stdout, "CapBnd"), DOCKER_DEFAULT_CAPS);
    assert_eq!(cap_field(&out.stdout, "CapEff"), DOCKER_DEFAULT_CAPS);
    assert_eq!(status_field(&out.stdout, "NoNewPrivs"), Some("1"));
    assert_eq!(status_field(&out.stdout, "Seccomp"), Some("2"));
}

#[test]
fn exec_process_is_in_the_box_cgroup() {
    let Some(root) = TestRoot::new("exec_process_is_in_the_box_cgroup") else {
        return;
    };
    root.detached_sh("lc-exec-cg", &["--pids", "50"], "sleep 60");
    // In the box's cgroup namespace, a process of the box cgroup sees "/" in every
    // hierarchy; one left outside it would see a path leading out ("/..").
    let out = root
        .run(&["exec", "lc-exec-cg", "--", "cat", "/proc/self/cgroup"])
        .ok();
    assert!(!out.stdout.trim().is_empty(), "{out}");
    for line in out.lines() {
        assert!(
            line.ends_with(":/"),
            "exec'd process outside the box cgroup: {line}\n{out}"
        );
    }
}

// ---------------------------------------------------------------- stop, kill, signals

#[test]
fn stop_ends_a_box_that_handles_term() {
    let Some(root) = TestRoot::new("stop_ends_a_box_that_handles_term") else {
        return;
    };
    root.detached_sh(
        "lc-stop-term",
        &[],
        "trap 'echo got-term; exit 0' TERM; echo ready; while :; do sleep 0.1; done",
    );
    root.wait_log("lc-stop-term", "ready", START);
    let t = Instant::now();
    root.run(&["stop", "-t", "10", "lc-stop-term"]).ok();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "stop waited {:?} for a box that exits on TERM",
        t.elapsed()
    );
    assert_eq!(root.wait_exited("lc-stop-term", START), 0);
    assert!(root.ok(&["logs", "lc-stop-term"]).contains("got-term"));
}

#[test]
fn stop_kills_a_box_that_ignores_term_after_the_timeout() {
    let Some(root) = TestRoot::new("stop_kills_a_box_that_ignores_term_after_the_timeout") else {
        return;
    };
    root.detached_sh(
        "lc-stop-kill",
        &[],
        "trap '' TERM; echo ready; while :; do sleep 0.1; done",
    );
    root.wait_log("lc-stop-kill", "ready", START);
    let t = Instant::now();
    root.run(&["stop", "-t", "1", "lc-stop-kill"]).ok();
    let took = t.elapsed();
    assert!(
        took >= Duration::from_secs(1),
        "stop -t 1 killed after only {took:?}"
    );
    assert!(took < Duration::from_secs(5), "stop -t 1 took {took:?}");
    assert_eq!(root.wait_exited("lc-stop-kill", START), 137);
}

#[test]
fn kill_sends_the_requested_signal() {
    let Some(root) = TestRoot::new("kill_sends_the_requested_signal") else {
        return;
    };
    root.detached_sh(
        "lc-kill-usr1",
        &[],
        "trap 'echo got-usr1; exit 5' USR1; echo ready; while :; do sleep 0.1; done",
    );
    root.wait_log("lc-kill-usr1", "ready", START);
    root.run(&["kill", "-s", "USR1", "lc-kill-usr1"]).ok();
    assert_eq!(root.wait_exited("lc-kill-usr1", START), 5);
    assert!(root.ok(&["logs", "lc-kill-usr1"]).contains("got-usr1"));
}

#[test]
fn kill_defaults_to_sigkill() {
    let Some(root) = TestRoot::new("kill_defaults_to_sigkill") else {
        return;
    };
    root.detached_sh("lc-kill", &[], "trap '' TERM INT; sleep 60");
    root.run(&["kill", "lc-kill"]).ok();
    assert_eq!(root.wait_exited("lc-kill", START), 137);
}

#[test]
fn sigterm_to_a_foreground_run_reaches_the_command() {
    let Some(root) = TestRoot::new("sigterm_to_a_foreground_run_reaches_the_command") else {
        return;
    };
    let out = sigterm_to_a_foreground_run(&root, &["--name", "lc-fg-term"]);
    assert_eq!(
        out.code, 9,
        "SIGTERM to nestbox run must reach the command\n{out}"
    );
}

// ---------------------------------------------------------------- rm, --rm

#[test]
fn rm_removes_an_exited_box_and_its_data() {
    let Some(root) = TestRoot::new("rm_removes_an_exited_box_and_its_data") else {
        return;
    };
    root.sh(&["--name", "lc-rm"], "echo x > /tmp/x").ok();
    root.inspect("lc-rm");
    root.run(&["rm", "lc-rm"]).ok();
    root.assert_no_boxes();
    // The name is free again.
    root.run(&["run", "--name", "lc-rm", "--", "true"]).ok();
}

#[test]
fn rm_force_removes_a_running_box_with_its_processes_and_cgroups() {
    let Some(root) = TestRoot::new("rm_force_removes_a_running_box_with_its_processes_and_cgroups")
    else {
        return;
    };
    root.detached_sh("lc-rm-force", &[], "sleep 60");
    let v = root.inspect("lc-rm-force");
    let init = v["state"]["init_pid"].as_i64().unwrap() as i32;
    let cgroups = cgroup_paths(&v);
    assert!(!cgroups.is_empty());
    root.run(&["rm", "-f", "lc-rm-force"]).ok();
    root.assert_no_boxes();
    for dir in cgroups.values() {
        assert!(
            !dir.exists(),
            "cgroup {} is left after rm -f",
            dir.display()
        );
    }
    wait_for("the box's init to be gone", Duration::from_secs(5), || {
        !pid_alive(init)
    });
}

/// `rm -f` of several running boxes kills them all first, then removes each:
/// every box goes with its processes, cgroups and veth, and a name that is
/// not a box is reported (exit code, one line naming it) without stopping
/// the removal of the others.
#[test]
fn rm_force_of_several_boxes_removes_each_and_reports_a_missing_one() {
    let Some(root) =
        TestRoot::new("rm_force_of_several_boxes_removes_each_and_reports_a_missing_one")
    else {
        return;
    };
    let names = ["lc-many-1", "lc-many-2", "lc-many-3"];
    let mut inits = Vec::new();
    let mut cgroups = Vec::new();
    let mut veths = Vec::new();
    for name in names {
        root.detached_sh(name, &[], "sleep 60");
        let v = root.inspect(name);
        inits.push(v["state"]["init_pid"].as_i64().unwrap() as i32);
        cgroups.extend(cgroup_paths(&v).into_values());
        veths.push(
            v["state"]["network"]["host_veth"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    assert!(veths
        .iter()
        .all(|v| std::path::Path::new("/sys/class/net").join(v).exists()));
    let out = root.run(&["rm", "-f", names[0], "lc-many-nope", names[1], names[2]]);
    assert_error(&out, 125, "lc-many-nope");
    assert_eq!(
        out.stderr.lines().count(),
        1,
        "one line, for the missing name: {}",
        out.stderr
    );
    root.assert_no_boxes();
    for dir in &cgroups {
        assert!(
            !dir.exists(),
            "cgroup {} is left after rm -f",
            dir.display()
        );
    }
    for veth in &veths {
        assert!(
            !std::path::Path::new("/sys/class/net").join(veth).exists(),
            "veth {veth} is left after rm -f"
        );
    }
    wait_for(
        "the boxes' inits to be gone",
        Duration::from_secs(5),
        || inits.iter().all(|p| !pid_alive(*p)),
    );
}

#[test]
fn rm_option_removes_the_box_when_it_exits() {
    let Some(root) = TestRoot::new("rm_option_removes_the_box_when_it_exits") else {
        return;
    };
    root.sh(&["--rm", "--name", "lc-autorm"], "exit 4").code(4);
    root.assert_no_boxes();
}

#[test]
fn detached_box_with_rm_is_removed_after_it_exits() {
    let Some(root) = TestRoot::new("detached_box_with_rm_is_removed_after_it_exits") else {
        return;
    };
    root.detached_sh("lc-autorm-d", &["--rm"], "sleep 0.5");
    wait_for("the --rm box to disappear", START, || {
        root.names().is_empty()
    });
    root.assert_no_boxes();
}

// ---------------------------------------------------------------- many boxes, dead monitors

#[test]
fn fifty_concurrent_runs_succeed_with_distinct_hostnames() {
    let Some(root) = TestRoot::new("fifty_concurrent_runs_succeed_with_distinct_hostnames") else {
        return;
    };
    let outs: Vec<Out> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..50)
            .map(|_| {
                s.spawn(|| {
                    root.run_timeout(
                        &["run", "--rm", "--", "sh", "-c", "echo $HOSTNAME"],
                        Duration::from_secs(180),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let failed: Vec<&Out> = outs
        .iter()
        .filter(|o| o.code != 0 || o.stdout.trim().is_empty())
        .collect();
    assert!(
        failed.is_empty(),
        "{} of 50 runs failed, first:\n{}",
        failed.len(),
        failed[0]
    );
    let names: std::collections::BTreeSet<&str> = outs.iter().map(|o| o.stdout.trim()).collect();
    assert_eq!(names.len(), 50, "hostnames are not distinct: {names:?}");
    root.assert_no_boxes();
}

#[test]
fn box_with_a_dead_monitor_is_dead_and_collected_by_gc() {
    let Some(root) = TestRoot::new("box_with_a_dead_monitor_is_dead_and_collected_by_gc") else {
        return;
    };
    root.detached_sh("lc-orphan", &[], "echo ready; sleep 60");
    root.wait_log("lc-orphan", "ready", START);
    let v = root.inspect("lc-orphan");
    let id = v["id"].as_str().unwrap().to_string();
    let monitor = v["state"]["monitor_pid"].as_i64().unwrap() as i32;
    let init = v["state"]["init_pid"].as_i64().unwrap() as i32;
    let cgroups = cgroup_paths(&v);
    assert!(!cgroups.is_empty());
    // SAFETY: kill has no memory-safety preconditions; the pid is the box's monitor.
    assert_eq!(unsafe { libc::kill(monitor, libc::SIGKILL) }, 0);
    wait_for("ps -a to show the box dead", START, || {
        root.status("lc-orphan").as_deref() == Some("dead")
    });
    wait_for(
        "the box's init to die with its monitor",
        Duration::from_secs(10),
        || !pid_alive(init),
    );
    let out = root.run(&["gc"]).ok();
    assert!(
        out.stdout.contains("lc-orphan"),
        "gc should report the dead box\n{out}"
    );
    assert!(root.names().is_empty(), "gc left the dead box listed");
    for dir in cgroups.values() {
        assert!(!dir.exists(), "gc left the cgroup {}", dir.display());
    }
    assert!(cgroup_dirs_of(&id).is_empty());
    root.assert_no_boxes();
}

#[test]
fn gc_leaves_boxes_of_other_roots_alone() {
    let Some(mine) = TestRoot::new("gc_leaves_boxes_of_other_roots_alone") else {
        return;
    };
    let Some(other) = TestRoot::new("gc_leaves_boxes_of_other_roots_alone (other root)") else {
        return;
    };
    mine.detached_sh("lc-not-yours", &[], "echo ready; sleep 60");
    mine.wait_log("lc-not-yours", "ready", START);
    let v = mine.inspect("lc-not-yours");
    let out = other.run(&["gc"]).ok();
    assert!(
        !out.stdout.contains(v["id"].as_str().unwrap()),
        "gc of another root collected this box\n{out}"
    );
    assert_eq!(
        mine.status("lc-not-yours").as_deref(),
        Some("running"),
        "gc of another root killed this box"
    );
    for dir in cgroup_paths(&v).values() {
        assert!(dir.exists(), "gc of another root removed {}", dir.display());
    }
}
