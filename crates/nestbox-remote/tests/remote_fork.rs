//! Scenario tests of remote fork, as root, without the nestbox runtime: a template
//! in its own pid and network namespaces with every kind of fd, confined like a
//! box (Docker capabilities, no_new_privs, nestbox's default seccomp filter plus
//! the setns/clone3 cookie rules), forked into clone shells built here, and
//! checked from the outside.
//!
//! Runs on libtest-mimic (`harness = false`): the binary is re-executed in the
//! roles of `common/roles.rs`, which a libtest main could not do; cases run one
//! at a time on the main thread. The command line is libtest's (filters,
//! `--skip`, `--exact`, `--list`); without root a case is skipped, and under
//! `CI=true` it fails instead.

#[path = "common/roles.rs"]
mod roles;
#[path = "common/scenario.rs"]
mod scenario;

use std::path::Path;
use std::time::Duration;

use nestbox_remote::{inspect_fds, CapState, FdAction, RemoteError, Tracee};
use nix::sys::signal::Signal;

use scenario::*;

fn main() {
    if let Ok(role) = std::env::var(roles::ROLE) {
        roles::run(&role);
    }
    let cases: &[(&str, fn())] = &[
        (
            "clone_of_epoll_template_gets_every_fd_row",
            clone_of_epoll_template,
        ),
        ("template_blocked_in_accept_resumes", blocked_in_accept),
        (
            "template_blocked_in_nanosleep_resumes",
            blocked_in_nanosleep,
        ),
        (
            "unsupported_fd_is_refused_before_anything_happens",
            unsupported_fd,
        ),
        ("failure_midway_leaves_nothing_behind", failure_midway),
        ("multi_threaded_template_is_refused", multi_threaded),
        ("already_traced_template_is_refused", already_traced),
        ("inspect_fds_classifies_every_kind", inspect_kinds),
        ("remote_fork_timing", timing),
    ];
    // libtest's command line (filters, --skip, --exact, --list, --ignored …)
    // through libtest-mimic; the cases share ptrace and fork state, so they run
    // one at a time on the main thread whatever --test-threads says.
    let mut args = libtest_mimic::Arguments::from_args();
    args.test_threads = Some(1);
    let trials = cases
        .iter()
        .map(|&(name, case)| {
            libtest_mimic::Trial::test(name, move || {
                if nestbox_testkit::require_root(name) {
                    case();
                }
                Ok(())
            })
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}

fn read_line_from(fd: &std::os::fd::OwnedFd, timeout: Duration) -> String {
    let dup = fd.try_clone().expect("dup");
    let rx = roles::line_channel(std::fs::File::from(dup));
    rx.recv_timeout(timeout)
        .expect("a line from the clone's stdout")
}

fn clone_of_epoll_template() {
    let mut sc = Scenario::start("");
    assert_eq!(
        sc.ready["setns_blocked"], "true",
        "the template's seccomp filter must block setns"
    );
    let shell = sc.shell();
    let p = sc.template;
    assert_eq!(ask(p, "inc"), "1");
    assert_eq!(ask(p, "inc"), "2");
    let template_ns_pid = ask(p, "pid");
    let maps_before = std::fs::read_to_string(format!("/proc/{p}/maps")).expect("maps");

    let null = dev_null();
    let (out_r, out_w) = pipe();
    let forked = sc
        .fork(shell, [&null, &out_w, &out_w], Some(Signal::SIGUSR1))
        .expect("remote_fork");
    println!("  remote_fork took {:?}", forked.elapsed);
    let g = forked.pid;
    let init = sc.shell_ref(shell).init;

    // Same port, in the shell's network namespace; same pid as the template had.
    assert_eq!(ask(init, "pid"), template_ns_pid);
    assert_eq!(forked.ns_pid.to_string(), template_ns_pid);
    assert_eq!(
        ask(init, "ppid"),
        "1",
        "the clone is adopted by the shell's init"
    );
    assert_eq!(status_field(g, "PPid"), init.to_string());

    // The on-clone signal went through the re-created signalfd and epoll.
    wait_until("the on-clone signal", Duration::from_secs(3), || {
        ask(init, "get") == "1002"
    });
    // Counters diverge; the template is untouched.
    assert_eq!(ask(p, "get"), "2");
    assert_eq!(ask(p, "inc"), "3");
    assert_eq!(ask(init, "inc"), "1003");
    assert_eq!(ask(p, "get"), "3");

    // Namespaces, cgroup, capability state.
    for kind in NS_KINDS {
        let name = kind.proc_name();
        let of = |pid: i32| std::fs::read_link(format!("/proc/{pid}/ns/{name}")).expect("ns link");
        assert_eq!(of(g), of(init), "{name} namespace");
        assert_ne!(of(g), of(p), "{name} namespace differs from the template's");
    }
    let cgroups = std::fs::read_to_string(format!("/proc/{g}/cgroup")).expect("cgroup");
    for cg in &sc.cgroups {
        let name = cg.file_name().and_then(|n| n.to_str()).expect("name");
        assert!(
            cgroups.contains(name),
            "clone not in {}: {cgroups}",
            cg.display()
        );
    }
    let (pc, gc) = (
        CapState::read(p).expect("caps"),
        CapState::read(g).expect("caps"),
    );
    assert_eq!(gc, pc, "capability state");
    assert!(gc.no_new_privs && gc.seccomp == 2);
    assert_eq!(gc.bounding, roles::docker_caps_mask());
    assert_eq!(ask(init, "hostname"), "clone-shell");

    // Rows of the fd matrix.
    let fd = |name: &str| sc.fd(name);
    // Regular file open for writing: reopened at the same offset in the clone's layer.
    assert!(
        !same_file(p, fd("log"), g, fd("log")),
        "log fd must be reopened"
    );
    assert_eq!(ask(init, "write clone"), "15");
    assert_eq!(ask(p, "write tmpl"), "14");
    let host_log = std::fs::read_to_string(sc.dir.join("data/log")).expect("log");
    assert_eq!(host_log, "template\ntmpl\n");
    let clone_log = if sc.shell_ref(shell).overlay {
        "upper/log"
    } else {
        "datacopy/log"
    };
    let clone_log = std::fs::read_to_string(sc.dir.join(clone_log)).expect("clone log");
    assert_eq!(clone_log, "template\nclone\n");
    // Read-only file, /dev/null, directory: shared.
    for name in ["ro", "null", "dir"] {
        assert!(
            same_file(p, fd(name), g, fd(name)),
            "{name} must stay shared"
        );
    }
    // stdio: the clone's own.
    for n in 0..3 {
        assert!(!same_file(p, n, g, n), "fd {n} must be replaced");
    }
    assert_eq!(ask(init, "out hello-from-clone"), "ok");
    assert_eq!(
        read_line_from(&out_r, Duration::from_secs(3)),
        "hello-from-clone"
    );
    // Re-created kinds: new open files, working.
    for name in [
        "tcp", "udp", "unix", "abstract", "eventfd", "timerfd", "signalfd", "epoll",
    ] {
        assert!(
            !same_file(p, fd(name), g, fd(name)),
            "{name} must be re-created"
        );
    }
    assert_eq!(ask_udp(init, "ping"), "udp 1003 ping");
    assert_eq!(ask_udp(p, "ping"), "udp 3 ping");
    let clone_unix = Path::new(&format!("/proc/{g}/root"))
        .join(sc.dir.join("run/sock").strip_prefix("/").expect("abs"));
    assert_eq!(ask_unix(&clone_unix, "get"), "1003");
    assert_eq!(ask_unix(&sc.dir.join("run/sock"), "get"), "3");
    assert_eq!(ask_abstract(init, &sc.abstract_name, "get"), "1003");
    assert_eq!(ask_abstract(p, &sc.abstract_name, "get"), "3");
    assert_eq!(
        ask(init, "eventfd"),
        "reads=5 value=1",
        "eventfd count and semaphore mode"
    );
    let timer = ask(init, "timer");
    let (left, interval) = timer.split_once(' ').expect("timer reply");
    let left: u64 = left.parse().expect("secs");
    assert!((980..=1000).contains(&left), "timer left {left}");
    assert_eq!(interval, "7");
    // Connected sockets: closed.
    for name in ["client", "server", "pair_a", "pair_b"] {
        assert!(
            !Path::new(&format!("/proc/{g}/fd/{}", fd(name))).exists(),
            "{name} must be closed"
        );
        assert!(Path::new(&format!("/proc/{p}/fd/{}", fd(name))).exists());
    }
    // The reported inventory agrees.
    let action = |fd: i32| {
        forked
            .fds
            .iter()
            .find(|o| o.fd == fd)
            .map(|o| o.action.clone())
    };
    assert_eq!(action(fd("log")), Some(FdAction::Reopen));
    assert_eq!(action(fd("ro")), Some(FdAction::Shared));
    assert_eq!(action(fd("client")), Some(FdAction::Close));
    assert_eq!(action(fd("epoll")), Some(FdAction::Recreate));
    assert_eq!(action(1), Some(FdAction::Stdio));

    // The template's memory map is as before (no scratch area left behind).
    let maps_after = std::fs::read_to_string(format!("/proc/{p}/maps")).expect("maps");
    assert_eq!(maps_before, maps_after);

    kill_and_wait_gone(g);
    let reaped = expect_line(
        &sc.shell_ref(shell).lines,
        "reaped ",
        Duration::from_secs(3),
    );
    assert_eq!(
        reaped,
        format!("reaped {template_ns_pid} 9"),
        "the shell's init reaps the clone"
    );
    assert_eq!(ask(p, "get"), "3", "the template survives its clone");
}

fn blocked_in_accept() {
    let mut sc = Scenario::start("blocking");
    let shell = sc.shell();
    let p = sc.template;
    assert_eq!(ask(p, "inc"), "1");
    // Let it block in accept() again.
    std::thread::sleep(Duration::from_millis(50));
    let wchan = std::fs::read_to_string(format!("/proc/{p}/wchan")).unwrap_or_default();
    let syscall = std::fs::read_to_string(format!("/proc/{p}/syscall")).unwrap_or_default();
    println!(
        "  template blocked in syscall {} ({wchan})",
        syscall.split_whitespace().next().unwrap_or("?")
    );
    let null = dev_null();
    let forked = sc
        .fork(shell, [&null, &null, &null], None)
        .expect("remote_fork");
    let init = sc.shell_ref(shell).init;
    for round in 0..3 {
        assert_eq!(ask(init, "inc"), (2 + round).to_string());
        assert_eq!(ask(p, "inc"), (2 + round).to_string());
    }
    kill_and_wait_gone(forked.pid);
}

fn blocked_in_nanosleep() {
    let mut sc = Scenario::start("sleeper");
    let shell = sc.shell();
    let tick = |line: String| -> u64 { line["tick ".len()..].parse().expect("tick") };
    expect_line(&sc.lines, "tick 3", Duration::from_secs(5));
    let (out_r, out_w) = pipe();
    let null = dev_null();
    let forked = sc
        .fork(shell, [&null, &out_w, &out_w], None)
        .expect("remote_fork");
    // The last tick the template printed before the fork.
    let mut last = 3;
    while let Ok(line) = sc.lines.try_recv() {
        if line.starts_with("tick ") {
            last = tick(line);
        }
    }
    let clone_lines = roles::line_channel(std::fs::File::from(out_r));
    let first = tick(expect_line(&clone_lines, "tick ", Duration::from_secs(3)));
    assert!(
        first <= last + 2 && first >= last.saturating_sub(1),
        "clone continues: template at {last}, clone at {first}"
    );
    let second = tick(expect_line(&clone_lines, "tick ", Duration::from_secs(3)));
    assert_eq!(second, first + 1);
    // The template keeps sleeping and ticking too.
    let t1 = tick(expect_line(&sc.lines, "tick ", Duration::from_secs(3)));
    let t2 = tick(expect_line(&sc.lines, "tick ", Duration::from_secs(3)));
    assert_eq!(t2, t1 + 1);
    kill_and_wait_gone(forked.pid);
}

fn unsupported_fd() {
    let mut sc = Scenario::start("inotify");
    let shell = sc.shell();
    let p = sc.template;
    let init = sc.shell_ref(shell).init;
    let before = (
        processes_in_pidns_of(p).len(),
        processes_in_pidns_of(init).len(),
    );
    let maps_before = std::fs::read_to_string(format!("/proc/{p}/maps")).expect("maps");
    let null = dev_null();
    let err = sc
        .fork(shell, [&null, &null, &null], None)
        .expect_err("must refuse");
    println!("  {err}");
    match &err {
        RemoteError::UnsupportedFd { pid, fd, kind, .. } => {
            assert_eq!(*pid, p);
            assert_eq!(*fd, sc.fd("inotify"));
            assert!(kind.contains("inotify"), "{kind}");
        }
        other => panic!("unexpected error {other}"),
    }
    assert!(err
        .to_string()
        .contains(&format!("fd {}", sc.fd("inotify"))));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        (
            processes_in_pidns_of(p).len(),
            processes_in_pidns_of(init).len()
        ),
        before
    );
    assert_eq!(
        std::fs::read_to_string(format!("/proc/{p}/maps")).expect("maps"),
        maps_before
    );
    assert_eq!(ask(p, "inc"), "1");
}

fn failure_midway() {
    let mut sc = Scenario::start("gone");
    let shell = sc.shell();
    let p = sc.template;
    let init = sc.shell_ref(shell).init;
    let before = (
        processes_in_pidns_of(p).len(),
        processes_in_pidns_of(init).len(),
    );
    let maps_before = std::fs::read_to_string(format!("/proc/{p}/maps")).expect("maps");
    let null = dev_null();
    let err = sc
        .fork(shell, [&null, &null, &null], None)
        .expect_err("must fail");
    println!("  {err}");
    assert_eq!(err.errno(), Some(libc::ENOENT), "{err}");
    assert!(
        err.to_string().contains("openat") && err.to_string().contains("gone/file"),
        "{err}"
    );
    wait_until(
        "the half-made processes to go",
        Duration::from_secs(3),
        || {
            (
                processes_in_pidns_of(p).len(),
                processes_in_pidns_of(init).len(),
            ) == before
        },
    );
    assert_eq!(
        std::fs::read_to_string(format!("/proc/{p}/maps")).expect("maps"),
        maps_before
    );
    assert_eq!(ask(p, "inc"), "1");
    assert!(
        try_ask(init, "get").is_none(),
        "nothing listens in the shell"
    );
}

/// Multi-threaded templates are cloned now (tests/remote_threads.rs has the
/// thorough checks): the clone has the template's two threads and answers.
fn multi_threaded() {
    let mut sc = Scenario::start("threads");
    let shell = sc.shell();
    let null = dev_null();
    let forked = sc
        .fork(shell, [&null, &null, &null], None)
        .expect("a two-thread template clones");
    assert_eq!(status_field(forked.pid, "Threads"), "2");
    assert_eq!(ask(forked.pid, "inc"), "1");
    assert_eq!(ask(sc.template, "inc"), "1");
    kill_and_wait_gone(forked.pid);
}

fn already_traced() {
    let sc = Scenario::start("");
    let mut first = Tracee::seize_and_interrupt(sc.template).expect("seize");
    first.wait_stopped(Duration::from_secs(2)).expect("stop");
    let err = Tracee::seize_and_interrupt(sc.template).expect_err("second seize");
    println!("  {err}");
    match err {
        RemoteError::AlreadyTraced { pid, tracer } => {
            assert_eq!(pid, sc.template);
            assert_eq!(tracer, std::process::id() as i32);
        }
        other => panic!("unexpected error {other}"),
    }
    first.detach().expect("detach");
    assert_eq!(ask(sc.template, "inc"), "1");
}

fn inspect_kinds() {
    let sc = Scenario::start("");
    let entries = inspect_fds(sc.template).expect("inspect");
    let action = |name: &str| {
        let fd = sc.fd(name);
        entries
            .iter()
            .find(|e| e.fd == fd)
            .map(|e| e.action())
            .unwrap_or_else(|| panic!("fd {name}"))
    };
    for (name, want) in [
        ("tcp", FdAction::Recreate),
        ("udp", FdAction::Recreate),
        ("unix", FdAction::Recreate),
        ("abstract", FdAction::Recreate),
        ("log", FdAction::Reopen),
        ("ro", FdAction::Shared),
        ("null", FdAction::Shared),
        ("dir", FdAction::Shared),
        ("eventfd", FdAction::Recreate),
        ("timerfd", FdAction::Recreate),
        ("signalfd", FdAction::Recreate),
        ("client", FdAction::Close),
        ("server", FdAction::Close),
        ("pair_a", FdAction::Close),
        ("epoll", FdAction::Recreate),
    ] {
        assert_eq!(action(name), want, "{name}");
    }
    let tcp = entries.iter().find(|e| e.fd == sc.fd("tcp")).expect("tcp");
    match &tcp.kind {
        nestbox_remote::FdKind::Socket(s) => {
            assert!(s.listening && s.reuseaddr && !s.connected);
            assert_eq!(s.backlog, Some(128), "std's listen backlog");
        }
        other => panic!("tcp is {other:?}"),
    }
    let epoll = entries
        .iter()
        .find(|e| e.fd == sc.fd("epoll"))
        .expect("epoll");
    match &epoll.kind {
        nestbox_remote::FdKind::Epoll(watches) => assert_eq!(watches.len(), 7),
        other => panic!("epoll is {other:?}"),
    }
}

fn timing() {
    let mut sc = Scenario::start("big");
    let shell = sc.shell();
    let init = sc.shell_ref(shell).init;
    let null = dev_null();
    let mut times = Vec::new();
    let mut phases_seen = Vec::new();
    // Taken once, as the runtime does at freeze time.
    let inventory = inspect_fds(sc.template).expect("inventory");
    for _ in 0..15 {
        wait_until("an empty shell", Duration::from_secs(5), || {
            processes_in_pidns_of(init).len() == 1
        });
        let forked = sc
            .fork_with(shell, [&null, &null, &null], None, Some(inventory.clone()))
            .expect("remote_fork");
        times.push(forked.elapsed);
        phases_seen.push(forked.phases.clone());
        println!(
            "  {:?}: {}",
            forked.elapsed,
            forked
                .phases
                .iter()
                .map(|(n, d)| format!("{n} {}us", d.as_micros()))
                .collect::<Vec<_>>()
                .join(", ")
        );
        assert_eq!(ask(init, "get"), "0");
        kill_and_wait_gone(forked.pid);
    }
    let mut without_cgroup: Vec<Duration> = phases_seen
        .iter()
        .map(|phases| {
            phases
                .iter()
                .filter(|(n, _)| *n != "cgroup")
                .map(|(_, d)| *d)
                .sum()
        })
        .collect();
    without_cgroup.sort();
    println!(
        "  without the cgroup write (host-dependent RCU wait): median {:?}",
        without_cgroup[without_cgroup.len() / 2]
    );
    times.sort();
    let median = times[times.len() / 2];
    println!(
        "  remote_fork of a 50 MB template: median {median:?}, min {:?}, max {:?} ({} runs)",
        times[0],
        times[times.len() - 1],
        times.len()
    );
}
