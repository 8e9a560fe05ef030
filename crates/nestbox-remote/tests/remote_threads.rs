//! Scenario tests of the remote fork of multi-threaded templates, as root,
//! without the nestbox runtime: the template of `common/thread_roles.rs` (nine
//! threads, each in another blocking state, with its own signal mask and
//! MXCSR, one with an alternate signal stack, two sharing a robust mutex) is
//! forked into clone shells of `common/scenario.rs` and checked from outside:
//! same tids, masks and per-thread kernel state, every thread going on from
//! the template's counts, the template untouched.
//!
//! Runs on libtest-mimic (`harness = false`) like `remote_fork.rs`: the binary is
//! re-executed in the scenario's roles; cases run one at a time on the main
//! thread. Without root a case is skipped, and under `CI=true` it fails instead.

#[allow(dead_code)]
#[path = "common/roles.rs"]
mod roles;
#[allow(dead_code)]
#[path = "common/scenario.rs"]
mod scenario;
#[path = "common/thread_roles.rs"]
mod thread_roles;

use std::collections::BTreeMap;
use std::time::Duration;

use nestbox_remote::{RemoteError, ThreadState, Tracee};

use scenario::*;
use thread_roles::{mxcsr_of, ALTSTACK, WORKERS};

fn main() {
    if let Ok(role) = std::env::var(roles::ROLE) {
        let mode = std::env::var("NBR_MODE").unwrap_or_default();
        let modes: Vec<&str> = mode.split(',').collect();
        if role == "template" && (modes.contains(&"mt") || modes.contains(&"zombie")) {
            thread_roles::template(modes.contains(&"zombie"), modes.contains(&"long"));
        }
        roles::run(&role);
    }
    let cases: &[(&str, fn())] = &[
        (
            "threads_of_a_template_continue_in_the_clone_with_their_state",
            threads_continue,
        ),
        ("clones_of_a_threaded_template_diverge", clones_diverge),
        (
            "sleep_resumed_after_an_earlier_stop_ends_with_eintr_in_a_later_clone",
            sleep_resumed_after_earlier_stop,
        ),
        ("template_without_its_main_thread_is_refused", zombie_leader),
    ];
    nestbox_testkit::run_root_cases(cases);
}

/// The threads of process `pid`: tid in its innermost pid namespace -> host tid.
fn tasks_by_ns_tid(pid: i32) -> BTreeMap<i32, i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("task dir")
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .map(|tid| {
            let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status"))
                .expect("task status");
            let ns: i32 = text
                .lines()
                .find_map(|l| l.strip_prefix("NSpid:"))
                .and_then(|v| v.split_whitespace().last())
                .and_then(|v| v.parse().ok())
                .expect("NSpid");
            (ns, tid)
        })
        .collect()
}

fn task_field(pid: i32, tid: i32, key: &str) -> String {
    let text =
        std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).expect("task status");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .map(|v| v.trim().to_string())
        .unwrap_or_default()
}

/// `counts=…` of a `get` answer.
fn counts(reply: &str) -> Vec<u64> {
    reply
        .split_whitespace()
        .find_map(|w| w.strip_prefix("counts="))
        .expect("counts")
        .split(',')
        .map(|c| c.parse().expect("count"))
        .collect()
}

fn field<'a>(reply: &'a str, key: &str) -> &'a str {
    reply
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} in {reply:?}"))
}

/// Every thread's state of process `pid`, read by seizing it (then detached),
/// by tid in its pid namespace.
fn thread_states(pid: i32) -> BTreeMap<i32, ThreadState> {
    let mut t = Tracee::seize_and_interrupt(pid).expect("seize");
    t.wait_stopped(Duration::from_secs(2)).expect("stop");
    let mut out = BTreeMap::new();
    let leader = ThreadState::capture(&mut t).expect("capture leader");
    out.insert(leader.ns_tid, leader);
    for thread in t.threads_mut() {
        let s = ThreadState::capture(thread).expect("capture thread");
        out.insert(s.ns_tid, s);
    }
    t.detach().expect("detach");
    out
}

/// Wait until every count of `pid`'s answer exceeds `than`.
fn wait_all_beyond(pid: i32, than: &[u64]) -> Vec<u64> {
    let mut last = Vec::new();
    wait_until("every thread to go on", Duration::from_secs(5), || {
        last = counts(&ask(pid, "get"));
        last.iter().zip(than).all(|(now, before)| now > before)
    });
    last
}

/// Whether the mapping of `pid` at `addr` has `dc` (`MADV_DONTFORK`) in its
/// `VmFlags`.
fn dontfork_marked(pid: i32, addr: u64) -> bool {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).expect("smaps");
    let mut inside = false;
    for line in smaps.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if inside {
                return flags.split_whitespace().any(|f| f == "dc");
            }
        } else if let Some((start, end)) = line
            .split_whitespace()
            .next()
            .and_then(|r| r.split_once('-'))
        {
            if let (Ok(s), Ok(e)) = (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16)) {
                inside = s <= addr && addr < e;
            }
        }
    }
    false
}

fn threads_continue() {
    let mut sc = Scenario::start("mt");
    let p = sc.template;
    assert_eq!(sc.ready["threads"], "9");
    let template_tasks = tasks_by_ns_tid(p);
    assert_eq!(template_tasks.len(), 9, "{template_tasks:?}");
    let shell = sc.shell();
    let null = dev_null();
    let before = counts(&ask(p, "get"));
    let forked = sc
        .fork(shell, [&null, &null, &null], None)
        .expect("remote_fork of a 9-thread template");
    println!(
        "  remote_fork of 9 threads took {:?}: {}",
        forked.elapsed,
        forked
            .phases
            .iter()
            .map(|(n, d)| format!("{n} {}us", d.as_micros()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let g = forked.pid;
    let init = sc.shell_ref(shell).init;

    // The same threads, by tid in the pid namespace, with the same masks.
    let clone_tasks = tasks_by_ns_tid(g);
    assert_eq!(
        clone_tasks.keys().collect::<Vec<_>>(),
        template_tasks.keys().collect::<Vec<_>>(),
        "thread ids in the clone's pid namespace"
    );
    for (ns, host) in &clone_tasks {
        let t = template_tasks[ns];
        for key in [
            "Name",
            "SigBlk",
            "SigIgn",
            "SigCgt",
            "Seccomp",
            "CapEff",
            "CapBnd",
            "NoNewPrivs",
        ] {
            assert_eq!(
                task_field(g, *host, key),
                task_field(p, t, key),
                "{key} of thread {ns}"
            );
        }
    }
    let masks: std::collections::BTreeSet<String> = clone_tasks
        .values()
        .map(|h| task_field(g, *h, "SigBlk"))
        .collect();
    assert_eq!(masks.len(), 9, "a distinct mask per thread: {masks:?}");

    // The MADV_DONTFORK region was carried, its mark too, in both.
    let template_df = ask(p, "get");
    let (df_addr, df_before) = field(&template_df, "dontfork=")
        .split_once(':')
        .expect("dontfork");
    let df_addr = u64::from_str_radix(df_addr.trim_start_matches("0x"), 16).expect("addr");
    let df_before: u64 = df_before.parse().expect("count");
    let clone_df = ask(init, "get");
    let (_, df_clone) = field(&clone_df, "dontfork=")
        .split_once(':')
        .expect("dontfork");
    assert!(df_clone.parse::<u64>().expect("count") > 0);
    for pid in [p, g] {
        assert!(
            dontfork_marked(pid, df_addr),
            "the page at {df_addr:#x} is MADV_DONTFORK in {pid}"
        );
        assert!(
            !dontfork_marked(pid, df_addr + 4096),
            "the page at {:#x} is not MADV_DONTFORK in {pid}",
            df_addr + 4096
        );
        assert!(
            dontfork_marked(pid, df_addr + 8192),
            "the page at {:#x} is MADV_DONTFORK in {pid}",
            df_addr + 8192
        );
        let mut word = [0u8; 8];
        let mem = std::fs::File::open(format!("/proc/{pid}/mem")).expect("mem");
        std::os::unix::fs::FileExt::read_exact_at(&mem, &mut word, df_addr + 8192)
            .expect("read the marker");
        assert_eq!(u64::from_ne_bytes(word), thread_roles::MARKER, "in {pid}");
    }
    println!("  MADV_DONTFORK counter: template {df_before}, clone {df_clone}");

    // Every thread goes on from where the template's was, in the clone.
    let first = counts(&ask(init, "get"));
    for (i, (c, b)) in first.iter().zip(&before).enumerate() {
        assert!(
            c >= b,
            "{}: clone's count {c} < template's {b} before the fork",
            WORKERS[i]
        );
    }
    let later = wait_all_beyond(init, &first);
    println!("  template before {before:?}, clone {first:?} then {later:?}");
    let reply = ask(init, "get");
    let want_mxcsr = (0..WORKERS.len())
        .map(|i| format!("{:#x}", mxcsr_of(i)))
        .collect::<Vec<_>>()
        .join(",");
    assert_eq!(
        field(&reply, "mxcsr="),
        want_mxcsr,
        "per-thread MXCSR (XSAVE area)"
    );
    for pair in ask(init, "ids").split(',') {
        let (cached, live) = pair.split_once('/').expect("ids pair");
        assert_eq!(
            cached, live,
            "a thread's gettid() is the tid it cached: {pair}"
        );
        assert!(clone_tasks.contains_key(&cached.parse().expect("tid")));
    }

    // Per-thread kernel state, read from outside, equal to the template's.
    let t_states = thread_states(p);
    let c_states = thread_states(g);
    for (ns, t) in &t_states {
        let c = &c_states[ns];
        assert_eq!(c.sigmask, t.sigmask, "sigmask of {ns}");
        assert_eq!(c.rseq, t.rseq, "rseq of {ns}");
        assert!(t.rseq.is_some(), "glibc registers rseq for thread {ns}");
        assert_eq!(c.robust_list, t.robust_list, "robust list of {ns}");
        assert_ne!(t.robust_list.0, 0, "glibc registers a robust list for {ns}");
        assert_eq!(c.altstack, t.altstack, "alternate stack of {ns}");
        assert_eq!(
            c.clear_child_tid, t.clear_child_tid,
            "clear_child_tid of {ns}"
        );
        assert_eq!(c.regs.fs_base, t.regs.fs_base, "TLS of {ns}");
        assert_eq!(c.fpu.1.len(), t.fpu.1.len(), "XSAVE area size of {ns}");
    }
    // Rust's runtime gives every thread a small alternate stack of its own (for
    // its stack overflow message); the altstack worker set a 64 KiB one.
    assert_eq!(
        t_states
            .values()
            .filter(|s| s.altstack.is_some_and(|(_, size, _)| size == 64 * 1024))
            .count(),
        1,
        "one thread has the 64 KiB alternate stack"
    );

    // The alternate stack works in the clone: SIGUSR1 to that thread runs its
    // handler on it.
    let alt_ns: i32 = ask(init, "ids")
        .split(',')
        .nth(ALTSTACK)
        .expect("alt")
        .split_once('/')
        .expect("pair")
        .0
        .parse()
        .expect("tid");
    assert_eq!(field(&ask(init, "get"), "onstack="), "0");
    nestbox_sys::process::tgkill(g, clone_tasks[&alt_ns], libc::SIGUSR1).expect("tgkill");
    wait_until(
        "the handler on the alternate stack",
        Duration::from_secs(2),
        || field(&ask(init, "get"), "onstack=") == "1",
    );

    // The template is untouched and goes on too; the two diverge.
    assert_eq!(tasks_by_ns_tid(p), template_tasks);
    assert_eq!(field(&ask(p, "get"), "onstack="), "0");
    assert_eq!(ask(init, "inc"), "1");
    assert_eq!(ask(init, "inc"), "2");
    assert_eq!(ask(p, "inc"), "1");
    let t_now = counts(&ask(p, "get"));
    wait_all_beyond(p, &t_now);
    assert_eq!(field(&ask(p, "get"), "mxcsr="), want_mxcsr);
    kill_and_wait_gone(g);
}

fn clones_diverge() {
    let mut sc = Scenario::start("mt");
    let p = sc.template;
    let null = dev_null();
    let mut clones = Vec::new();
    for _ in 0..3 {
        let shell = sc.shell();
        let forked = sc
            .fork(shell, [&null, &null, &null], None)
            .expect("remote_fork");
        clones.push((forked.pid, sc.shell_ref(shell).init));
    }
    for (n, (_, init)) in clones.iter().enumerate() {
        for _ in 0..=n {
            ask(*init, "inc");
        }
    }
    for (n, (g, init)) in clones.iter().enumerate() {
        assert_eq!(
            ask(*init, "inc"),
            (n + 2).to_string(),
            "clone {n} diverged alone"
        );
        assert_eq!(tasks_by_ns_tid(*g).len(), 9);
        let c = counts(&ask(*init, "get"));
        wait_all_beyond(*init, &c);
    }
    assert_eq!(ask(p, "inc"), "1", "the template saw none of it");
    for (g, _) in clones {
        kill_and_wait_gone(g);
    }
}

/// A relative sleep interrupted by a stop resumes, once let go, through
/// `restart_syscall`, which no longer says which call it resumes: a clone made
/// at the next stop gets EINTR from it (as with a signal handler), while a
/// clone made at the first stop re-runs the sleep in full.
fn sleep_resumed_after_earlier_stop() {
    let mut sc = Scenario::start("mt,long");
    assert_eq!(sc.ready["threads"], "10");
    let p = sc.template;
    let long = |pid: i32| -> (u64, u64) {
        let reply = ask(pid, "get");
        let (rounds, eintr) = field(&reply, "long=").split_once(':').expect("long");
        (
            rounds.parse().expect("rounds"),
            eintr.parse().expect("eintr"),
        )
    };
    assert_eq!(long(p), (1, 0));
    let null = dev_null();
    let first_shell = sc.shell();
    let first = sc
        .fork(first_shell, [&null, &null, &null], None)
        .expect("first remote_fork");
    let first_init = sc.shell_ref(first_shell).init;
    // Let the template's sleeper resume (through restart_syscall).
    std::thread::sleep(Duration::from_millis(200));
    let second_shell = sc.shell();
    let second = sc
        .fork(second_shell, [&null, &null, &null], None)
        .expect("second remote_fork");
    let second_init = sc.shell_ref(second_shell).init;
    wait_until(
        "the sleep to end with EINTR",
        Duration::from_secs(5),
        || long(second_init) == (2, 1),
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(long(first_init), (1, 0), "the first clone sleeps on");
    assert_eq!(long(p), (1, 0), "the template sleeps on");
    kill_and_wait_gone(first.pid);
    kill_and_wait_gone(second.pid);
}

fn zombie_leader() {
    let sc = Scenario::start("zombie");
    let p = sc.template;
    wait_until("the main thread to exit", Duration::from_secs(5), || {
        status_field(p, "State").starts_with('Z')
    });
    let err = Tracee::seize_and_interrupt(p).expect_err("must refuse");
    println!("  {err}");
    match err {
        RemoteError::ZombieLeader { pid, threads } => {
            assert_eq!(pid, p);
            assert_eq!(threads, 2);
        }
        other => panic!("unexpected error {other}"),
    }
    assert_eq!(status_field(p, "TracerPid"), "0", "nothing left attached");
    // The namespaces of a zombie leader are gone from /proc: ask through the
    // server thread.
    let server = *tasks_by_ns_tid(p)
        .values()
        .find(|t| **t != p)
        .expect("the server thread");
    assert_eq!(ask(server, "inc"), "1", "the server thread runs on");
}
