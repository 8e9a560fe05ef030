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
        ("multi_threaded_template_is_forked", multi_threaded),
        ("already_traced_template_is_refused", already_traced),
        ("inspect_fds_classifies_every_kind", inspect_kinds),
        ("pipe_data_is_carried_over", pipe_data),
        ("socket_pairs_carry_data_both_ways", socket_pairs),
        ("unix_connection_inside_the_box_is_a_pair", unix_connection),
        (
            "outside_connection_becomes_a_reset_placeholder",
            outside_placeholder,
        ),
        ("inotify_is_recreated_with_its_watches", inotify_watches),
        ("pidfd_of_the_process_points_to_the_clone", own_pidfd),
        ("fds_in_flight_are_refused", fds_in_flight),
        ("remote_fork_timing", timing),
    ];
    nestbox_testkit::run_root_cases(cases);
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
    // Connected sockets: new objects on the same numbers.
    for name in ["client", "server", "pair_a", "pair_b"] {
        assert!(
            Path::new(&format!("/proc/{g}/fd/{}", fd(name))).exists(),
            "{name} must stay taken"
        );
        assert!(!same_file(p, fd(name), g, fd(name)), "{name} must be new");
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
    assert_eq!(action(fd("client")), Some(FdAction::Placeholder));
    assert_eq!(action(fd("pair_a")), Some(FdAction::Pair));
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
    let mut sc = Scenario::start("unsupported");
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
            assert_eq!(*fd, sc.fd("otherpidfd"));
            assert!(kind.contains("pidfd"), "{kind}");
        }
        other => panic!("unexpected error {other}"),
    }
    assert!(err
        .to_string()
        .contains(&format!("fd {}", sc.fd("otherpidfd"))));
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
        ("client", FdAction::Placeholder),
        ("server", FdAction::Placeholder),
        ("pair_a", FdAction::Pair),
        ("pair_b", FdAction::Pair),
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

/// A template of mode `pairs` forked once into a shell: (scenario, template,
/// clone, the shell's init).
fn forked_pairs() -> (Scenario, i32, i32, i32) {
    let (sc, p, g, init, _peer) = forked_pairs_with_peer();
    (sc, p, g, init)
}

/// [`forked_pairs`], with the outside end of the template's `outside` Unix
/// connection (which sent "outside-data" before the fork).
fn forked_pairs_with_peer() -> (Scenario, i32, i32, i32, std::os::unix::net::UnixStream) {
    let mut sc = Scenario::start("pairs");
    let (mut peer, _) = sc
        .outside
        .accept()
        .expect("accept the template's connection");
    std::io::Write::write_all(&mut peer, b"outside-data").expect("send");
    let shell = sc.shell();
    let null = dev_null();
    let forked = sc
        .fork(shell, [&null, &null, &null], None)
        .expect("remote_fork");
    let (p, g, init) = (sc.template, forked.pid, sc.shell_ref(shell).init);
    let retarget = forked
        .phases
        .iter()
        .find(|(name, _)| *name == "fd re-targeting")
        .map(|(_, d)| *d);
    println!(
        "  remote_fork {:?}, of which fd re-targeting {retarget:?} ({} fds)",
        forked.elapsed,
        forked.fds.len()
    );
    (sc, p, g, init, peer)
}

/// Bytes queued in fd `fd` of `pid`, seen through a duplicate (FIONREAD).
fn queued(pid: i32, fd: i32) -> i32 {
    let pidfd = nestbox_sys::pidfd::pidfd_open(pid).expect("pidfd_open");
    let dup =
        nestbox_sys::pidfd::pidfd_getfd(std::os::fd::AsFd::as_fd(&pidfd), fd).expect("pidfd_getfd");
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int.
    let rc = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&dup),
            libc::FIONREAD,
            &mut n,
        )
    };
    assert_eq!(rc, 0, "FIONREAD: {}", std::io::Error::last_os_error());
    n
}

fn fdinfo(pid: i32, fd: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).expect("fdinfo")
}

fn fd_flags(pid: i32, fd: i32) -> i32 {
    let info = fdinfo(pid, fd);
    let flags = info
        .lines()
        .find_map(|l| l.strip_prefix("flags:"))
        .expect("flags");
    i32::from_str_radix(flags.trim(), 8).expect("octal")
}

fn pipe_data() {
    let (sc, p, g, init) = forked_pairs();
    let fd = |n: &str| sc.fd(n);
    let (r, r2, w, half) = (fd("pipe_r"), fd("pipe_r2"), fd("pipe_w"), fd("half_r"));
    for n in [r, w, half] {
        assert!(!same_file(p, n, g, n), "fd {n} must be a new pipe");
    }
    assert!(same_file(g, r, g, r2), "dup'd fds stay one open file");
    assert_eq!(
        queued(g, r),
        10,
        "the clone's pipe holds the template's data"
    );
    assert_eq!(ask(init, &format!("read {r}")), "data pipe-data|");
    assert_eq!(
        ask(init, &format!("read {r2}")),
        "none",
        "one pipe, read once"
    );
    assert_eq!(ask(init, &format!("send {w} clone")), "ok 5");
    assert_eq!(ask(init, &format!("read {r2}")), "data clone");
    // Flags carried: the read end is non-blocking, both close-on-exec.
    assert_ne!(fd_flags(g, r) & libc::O_NONBLOCK, 0);
    assert_eq!(fd_flags(g, w) & libc::O_NONBLOCK, 0);
    assert_ne!(fd_flags(g, w) & libc::O_CLOEXEC, 0);
    // A FIFO opened for reading and writing: a new pipe, opened so, with the data.
    let fifo = fd("fifo");
    assert!(!same_file(p, fifo, g, fifo));
    assert_eq!(fd_flags(g, fifo) & libc::O_ACCMODE, libc::O_RDWR);
    assert_eq!(ask(init, &format!("read {fifo}")), "data fifo-data");
    assert_eq!(ask(init, &format!("send {fifo} again")), "ok 5");
    assert_eq!(ask(init, &format!("read {fifo}")), "data again");
    assert_eq!(queued(p, fifo), 9);
    // A pipe whose writer is gone: its data, then end of file.
    assert_eq!(ask(init, &format!("read {half}")), "data last words");
    assert_eq!(ask(init, &format!("read {half}")), "eof");
    // The template's pipes are untouched.
    assert_eq!(queued(p, r), 10);
    assert_eq!(queued(p, half), 10);
    assert_eq!(ask(p, &format!("read {r}")), "data pipe-data|");
    assert_eq!(ask(p, &format!("read {half}")), "data last words");
    kill_and_wait_gone(g);
}

fn socket_pairs() {
    let (sc, p, g, init) = forked_pairs();
    let fd = |n: &str| sc.fd(n);
    let (a, b, da, db) = (fd("s_a"), fd("s_b"), fd("d_a"), fd("d_b"));
    for n in [a, b, da, db] {
        assert!(!same_file(p, n, g, n), "fd {n} must be a new socket");
    }
    assert_eq!(ask(init, &format!("read {b}")), "data to-b|");
    assert_eq!(ask(init, &format!("read {a}")), "data to-a|");
    assert_eq!(ask(init, &format!("send {a} ping")), "ok 4");
    assert_eq!(ask(init, &format!("read {b}")), "data ping");
    assert_eq!(ask(init, &format!("send {b} pong")), "ok 4");
    assert_eq!(ask(init, &format!("read {a}")), "data pong");
    // Datagram boundaries are kept, in both directions.
    assert_eq!(ask(init, &format!("recvs {db}")), "msgs m1,msg2,third");
    assert_eq!(ask(init, &format!("recvs {da}")), "msgs back");
    assert_eq!(ask(init, &format!("send {da} x1")), "ok 2");
    assert_eq!(ask(init, &format!("send {da} x22")), "ok 3");
    assert_eq!(ask(init, &format!("recvs {db}")), "msgs x1,x22");
    // A client of the box's datagram server is connected to the clone's.
    let (srv, cli) = (fd("dsrv"), fd("dcli"));
    assert!(!same_file(p, cli, g, cli));
    assert_eq!(ask(init, &format!("send {cli} hello")), "ok 5");
    assert_eq!(ask(init, &format!("recvs {srv}")), "msgs hello");
    assert_eq!(ask(p, &format!("recvs {srv}")), "msgs");
    // The template's queues are as they were (and its peek offset unset).
    assert_eq!(queued(p, b), 5);
    assert_eq!(ask(p, &format!("read {b}")), "data to-b|");
    assert_eq!(ask(p, &format!("read {a}")), "data to-a|");
    assert_eq!(ask(p, &format!("recvs {db}")), "msgs m1,msg2,third");
    assert_eq!(ask(p, &format!("recvs {da}")), "msgs back");
    kill_and_wait_gone(g);
}

fn unix_connection() {
    let (sc, p, g, init) = forked_pairs();
    let (c, s) = (sc.fd("c_client"), sc.fd("c_server"));
    for n in [c, s] {
        assert!(!same_file(p, n, g, n), "fd {n} must be a new socket");
    }
    assert_eq!(ask(init, &format!("read {s}")), "data from-client|");
    assert_eq!(ask(init, &format!("read {c}")), "data from-server|");
    assert_eq!(ask(init, &format!("send {c} again")), "ok 5");
    assert_eq!(ask(init, &format!("read {s}")), "data again");
    assert_eq!(queued(p, s), 12);
    assert_eq!(ask(p, &format!("read {s}")), "data from-client|");
    assert_eq!(ask(p, &format!("read {c}")), "data from-server|");
    kill_and_wait_gone(g);
}

fn outside_placeholder() {
    let (sc, p, g, init, peer) = forked_pairs_with_peer();
    let (client, server) = (sc.fd("client"), sc.fd("server"));
    for n in [client, server] {
        assert!(!same_file(p, n, g, n), "fd {n} must be a placeholder");
    }
    // The clone's epoll loop was woken by the reset.
    wait_until("the clone's loop to notice", Duration::from_secs(3), || {
        ask(init, "noticed") != "0x0"
    });
    let events = u32::from_str_radix(ask(init, "noticed").trim_start_matches("0x"), 16).unwrap();
    assert_ne!(events & libc::EPOLLERR as u32, 0, "events {events:#x}");
    assert_ne!(events & libc::EPOLLHUP as u32, 0, "events {events:#x}");
    assert_eq!(
        ask(p, "noticed"),
        "0x0",
        "the template's connection is alive"
    );
    // Reads: reset, then end of file; writes: broken pipe.
    assert_eq!(
        ask(init, &format!("read {client}")),
        format!("err {}", libc::ECONNRESET)
    );
    assert_eq!(ask(init, &format!("read {client}")), "eof");
    assert_eq!(
        ask(init, &format!("send {client} x")),
        format!("err {}", libc::EPIPE)
    );
    assert_eq!(
        ask(init, &format!("read {server}")),
        format!("err {}", libc::ECONNRESET)
    );
    // The numbers stay taken: a new socket gets another one.
    let fresh: i32 = ask(init, "socket").parse().unwrap();
    assert!(fresh != client && fresh != server, "new socket got {fresh}");
    assert!(Path::new(&format!("/proc/{g}/fd/{client}")).exists());
    // The template's connection still works.
    assert_eq!(ask(p, &format!("send {client} hi")), "ok 2");
    assert_eq!(ask(p, &format!("read {server}")), "data hi");
    // A Unix connection to outside the box: the data it had received, then a
    // reset, then end of file; the template's connection is alive.
    let outside = sc.fd("outside");
    assert!(!same_file(p, outside, g, outside));
    assert_eq!(ask(init, &format!("read {outside}")), "data outside-data");
    assert_eq!(
        ask(init, &format!("read {outside}")),
        format!("err {}", libc::ECONNRESET)
    );
    assert_eq!(ask(init, &format!("read {outside}")), "eof");
    assert_eq!(ask(p, &format!("read {outside}")), "data outside-data");
    assert_eq!(ask(p, &format!("read {outside}")), "none");
    assert_eq!(ask(p, &format!("send {outside} back")), "ok 4");
    let mut got = [0u8; 4];
    std::io::Read::read_exact(&mut &peer, &mut got).expect("the template's data");
    assert_eq!(&got, b"back");
    kill_and_wait_gone(g);
}

fn inotify_watches() {
    let (sc, p, g, init) = forked_pairs();
    let ino = sc.fd("inotify");
    assert_eq!((sc.fd("wa"), sc.fd("wc")), (1, 3), "the template's wds");
    assert!(!same_file(p, ino, g, ino));
    let watches = |pid: i32| -> Vec<(String, String)> {
        fdinfo(pid, ino)
            .lines()
            .filter(|l| l.starts_with("inotify "))
            .map(|l| {
                let field = |k: &str| {
                    l.split_whitespace()
                        .find_map(|t| t.strip_prefix(k))
                        .unwrap_or("")
                        .to_string()
                };
                (field("wd:"), field("mask:"))
            })
            .collect()
    };
    let mut theirs = watches(g);
    theirs.sort();
    assert_eq!(
        theirs,
        vec![("1".into(), "100".into()), ("3".into(), "300".into())]
    );
    assert_ne!(fd_flags(g, ino) & libc::O_NONBLOCK, 0);
    assert_eq!(
        ask(init, &format!("inotify {ino}")),
        "events",
        "no event left over"
    );
    let wa = sc.dir.join("data/wa");
    let wc = sc.dir.join("data/wc");
    assert_eq!(
        ask(init, &format!("touch {}", wa.join("x").display())),
        "ok"
    );
    assert_eq!(
        ask(init, &format!("touch {}", wc.join("y").display())),
        "ok"
    );
    assert_eq!(
        ask(init, &format!("inotify {ino}")),
        "events 1:100:x,3:100:y"
    );
    // The clone's files are its own: the template saw nothing, and the
    // template's own changes are not the clone's.
    assert_eq!(ask(p, &format!("inotify {ino}")), "events");
    assert_eq!(ask(p, &format!("touch {}", wa.join("t").display())), "ok");
    assert_eq!(ask(p, &format!("inotify {ino}")), "events 1:100:t");
    assert_eq!(ask(init, &format!("inotify {ino}")), "events");
    kill_and_wait_gone(g);
}

fn own_pidfd() {
    let (sc, p, g, init) = forked_pairs();
    let fd = sc.fd("pidfd");
    let pid_of = |pid: i32| -> String {
        fdinfo(pid, fd)
            .lines()
            .find_map(|l| l.strip_prefix("Pid:"))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    assert!(!same_file(p, fd, g, fd), "a new pidfd");
    assert_eq!(pid_of(p), p.to_string());
    assert_eq!(
        pid_of(g),
        g.to_string(),
        "the clone's pidfd is of the clone"
    );
    assert_ne!(fd_flags(g, fd) & libc::O_CLOEXEC, 0);
    assert_eq!(ask(init, &format!("pidfd {fd}")), "ok");
    kill_and_wait_gone(g);
    assert_eq!(ask(p, &format!("pidfd {fd}")), "ok");
}

fn fds_in_flight() {
    let mut sc = Scenario::start("scmrights");
    let shell = sc.shell();
    let p = sc.template;
    let init = sc.shell_ref(shell).init;
    let maps_before = std::fs::read_to_string(format!("/proc/{p}/maps")).expect("maps");
    // Refused by the inventory already (what freeze runs), and by the fork.
    let entries = inspect_fds(p).expect("inspect");
    let at_freeze = nestbox_remote::ensure_clonable(p, &entries).expect_err("must refuse");
    assert!(at_freeze.to_string().contains("SCM_RIGHTS"), "{at_freeze}");
    let null = dev_null();
    let err = sc
        .fork(shell, [&null, &null, &null], None)
        .expect_err("must refuse");
    println!("  {err}");
    match &err {
        RemoteError::UnsupportedFd {
            pid, fd, reason, ..
        } => {
            assert_eq!(*pid, p);
            assert_eq!(*fd, sc.fd("rights_b"));
            assert!(reason.contains("SCM_RIGHTS"), "{reason}");
        }
        other => panic!("unexpected error {other}"),
    }
    assert_eq!(err.to_string().lines().count(), 1);
    wait_until(
        "the half-made processes to go",
        Duration::from_secs(3),
        || processes_in_pidns_of(init).len() == 1,
    );
    assert_eq!(
        std::fs::read_to_string(format!("/proc/{p}/maps")).expect("maps"),
        maps_before
    );
    // The message and its fd are still queued for the template.
    assert_eq!(queued(p, sc.fd("rights_b")), 1);
    assert_eq!(ask(p, "inc"), "1");
}
