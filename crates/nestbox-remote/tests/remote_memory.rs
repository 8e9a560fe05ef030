//! Scenario tests of the clone's memory, as root, without the nestbox runtime:
//! shared memory of every kind (shared anonymous, memfd mapped and as fd,
//! `/dev/shm` file, file on the root, System V segment) becomes private to the
//! clone, and stays shared between the ways one process reaches it.
//!
//! Runs on libtest-mimic (`harness = false`), like `remote_fork.rs`: the binary is
//! re-executed in the roles of `common/roles.rs` (the scenario's namespaces and
//! clone shells) and `memory/roles.rs` (the memory template).

#[path = "memory/roles.rs"]
mod memory_roles;
#[allow(dead_code)]
#[path = "common/roles.rs"]
mod roles;
#[allow(dead_code)]
#[path = "common/scenario.rs"]
mod scenario;

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use nestbox_remote::maps::{read_maps, read_smaps, Vma};
use nestbox_remote::rebuild::{fork_stopped, make_like, resume_with, RebuildStats};
use nestbox_remote::{ensure_memory_clonable, FdAction, RemoteError, SharedObjects, Tracee};

use scenario::*;

fn main() {
    if let Ok(role) = std::env::var(roles::ROLE) {
        let mode = std::env::var("NBR_MODE").unwrap_or_default();
        if role == "template" {
            match mode.as_str() {
                "memory" | "memory-partial" => memory_roles::memory_template(),
                "rebuild" => memory_roles::rebuild_template(false),
                "rebuild-exec" => memory_roles::rebuild_template(true),
                _ => {}
            }
        }
        roles::run(&role);
    }
    let cases: &[(&str, fn())] = &[
        ("shared_memory_is_private_to_the_clone", shared_private),
        (
            "partly_attached_segment_is_refused_before_anything_happens",
            partly_attached,
        ),
        ("rebuild_into_a_forked_child", rebuild_forked),
        ("rebuild_into_an_exec_child", rebuild_exec),
        (
            "a_tracee_killed_while_traced_is_detached_without_error",
            killed_tracee,
        ),
    ];
    nestbox_testkit::run_root_cases(cases);
}

/// A `get`/`inc` reply as name -> the values of each way to it.
fn parse(reply: &str) -> HashMap<String, Vec<String>> {
    reply
        .split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.split('/').map(str::to_string).collect()))
        .collect()
}

/// Every counter equals `n` through every way to it (deep is a byte, only the
/// fd-only memfd's counter, pos its offset).
fn assert_all(reply: &str, n: u64, who: &str) {
    let got = parse(reply);
    for name in [
        "anon", "memfd", "shm", "file", "sysv", "only", "dest", "deleted",
    ] {
        let values = got
            .get(name)
            .unwrap_or_else(|| panic!("{who}: no {name} in {reply}"));
        for v in values {
            assert_eq!(v, &n.to_string(), "{who}: {name} in {reply}");
        }
    }
    assert_eq!(got["deep"], vec![(n % 256).to_string()], "{who}: {reply}");
    assert_eq!(
        got["pos"],
        vec!["5".to_string()],
        "{who}: fd offset, {reply}"
    );
}

/// (dev, ino) of each shared mapping whose name contains `needle`.
fn objects(pid: i32, needle: &str) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = read_maps(pid)
        .expect("maps")
        .into_iter()
        .filter(|m| m.shared && m.name.contains(needle))
        .map(|m| m.object())
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Removes the template's `/dev/shm` file and System V segment (both in the
/// host's namespaces) at the end of a case.
struct Cleanup(String, i32);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        // SAFETY: shmctl(IPC_RMID) with plain integers and no buffer.
        unsafe { libc::shmctl(self.1, libc::IPC_RMID, std::ptr::null_mut()) };
    }
}

fn shared_private() {
    let mut sc = Scenario::start("memory");
    let p = sc.template;
    let shm_file = sc.ready["shm"].clone();
    let _cleanup = Cleanup(shm_file.clone(), sc.ready["shmid"].parse().expect("shmid"));
    assert_all(&ask(p, "get"), 0, "template");
    assert_all(&ask(p, "inc"), 1, "template");
    assert_all(&ask(p, "inc"), 2, "template");
    let template_shmid = ask(p, "shmid");
    let shell = sc.shell();
    let init = sc.shell_ref(shell).init;
    let null = dev_null();
    let forked = sc
        .fork(shell, [&null, &null, &null], None)
        .expect("remote_fork");
    let g = forked.pid;
    println!("  remote_fork took {:?}", forked.elapsed);

    // The clone continues from the template's values.
    assert_all(&ask(init, "get"), 2, "clone");
    // Its writes are seen through every way the clone reaches each object...
    assert_all(&ask(init, "inc"), 3, "clone");
    // ...and not by the template.
    assert_all(&ask(p, "get"), 2, "template after the clone's write");
    assert_all(&ask(p, "inc"), 3, "template");
    assert_all(&ask(p, "inc"), 4, "template");
    // The template's later state is not visible in the clone.
    assert_all(&ask(init, "get"), 3, "clone after the template's writes");

    // New objects: other inodes, same names; the System V segment has the same
    // key and id in the clone's IPC namespace.
    for needle in [
        "/dev/zero",
        "/memfd:nbmem",
        "/SYSV",
        "shared.bin",
        &shm_file,
    ] {
        let (t, c) = (objects(p, needle), objects(g, needle));
        assert!(!t.is_empty(), "template maps {needle}");
        if needle == "/SYSV" {
            // A segment's inode is its id, which the clone's segments keep.
            assert_eq!(t, c, "same segment ids");
            assert_eq!(c.len(), 2, "the keyed segment and the removed one");
        } else {
            assert_eq!(c.len(), 1, "clone: one object for {needle}: {c:?}");
            assert!(
                !t.contains(&c[0]),
                "{needle}: the clone's object is a new one"
            );
        }
    }
    assert_eq!(
        ask(init, "shmid"),
        template_shmid,
        "same shmid in the clone"
    );
    let ipc = |pid: i32| std::fs::read_link(format!("/proc/{pid}/ns/ipc")).expect("ipc ns");
    assert_ne!(
        ipc(g),
        ipc(p),
        "the clone's segment is in its own IPC namespace"
    );
    // The fd-only memfd and the mapped memfd's fd point to the new objects.
    let fd_obj = |pid: i32, fd: &str| {
        let m = std::fs::metadata(format!("/proc/{pid}/fd/{fd}")).expect("fd");
        (m.dev(), m.ino())
    };
    for name in ["memfd", "only"] {
        let fd = &sc.ready[name];
        assert_ne!(fd_obj(p, fd), fd_obj(g, fd), "{name} fd is a new object");
        let link = std::fs::read_link(format!("/proc/{g}/fd/{fd}")).expect("link");
        assert!(
            link.to_string_lossy().starts_with("/memfd:nb"),
            "{name}: {link:?}"
        );
        let action = forked
            .fds
            .iter()
            .find(|o| o.fd.to_string() == *fd)
            .map(|o| o.action.clone());
        assert_eq!(action, Some(FdAction::CopyShared), "{name}");
    }
    assert_eq!(objects(g, "/memfd:nbmem")[0], fd_obj(g, &sc.ready["memfd"]));
    // The deleted file open for writing: a memfd named after it, with its contents.
    let fd = &sc.ready["deleted"];
    assert_ne!(
        fd_obj(p, fd),
        fd_obj(g, fd),
        "deleted file fd is a new object"
    );
    let link = std::fs::read_link(format!("/proc/{g}/fd/{fd}")).expect("link");
    assert!(
        link.to_string_lossy().starts_with("/memfd:")
            && link.to_string_lossy().contains("data/deleted.bin"),
        "{link:?}"
    );
    // The template's files on disk hold the template's values, the clone's layer its own.
    let host_file = std::fs::read(sc.dir.join("data/shared.bin")).expect("file");
    assert_eq!(u64::from_ne_bytes(host_file[..8].try_into().expect("8")), 4);
    if sc.shell_ref(shell).overlay {
        let upper = std::fs::read(sc.dir.join("upper/shared.bin")).expect("upper");
        assert_eq!(u64::from_ne_bytes(upper[..8].try_into().expect("8")), 3);
    }
    kill_and_wait_gone(g);
    assert_all(&ask(p, "get"), 4, "template after the clone is gone");
}

/// The layout as compared between X and B: range, protection, sharing, name.
/// Adjacent private anonymous mappings with the same protection and name count
/// as one: the kernel merges a new anonymous mapping into its neighbour in X
/// where B's kernel kept them apart for their history (different `anon_vma`),
/// which nothing but `/proc/PID/maps` can tell apart.
fn shape(vmas: &[Vma]) -> Vec<(u64, u64, i32, bool, String)> {
    let mut out: Vec<(u64, u64, i32, bool, String)> = Vec::new();
    for v in vmas {
        if let Some(last) = out.last_mut() {
            let anon = !v.shared && !v.is_file();
            if anon && last.1 == v.start && last.2 == v.prot && !last.3 && last.4 == v.name {
                last.1 = v.end;
                continue;
            }
        }
        out.push((v.start, v.end, v.prot, v.shared, v.name.clone()));
    }
    out
}

extern "C" {
    /// glibc's offset of the thread's rseq area from the thread pointer.
    static __rseq_offset: isize;
}

/// X's address space equals B's: the same mappings, and the same bytes in every
/// readable one (through /proc/PID/mem); `[vvar]` pages hold the kernel's clock
/// data and are skipped, and so are the fields of the rseq area the kernel
/// rewrites for the CPU each process last ran on (cpu_id_start, cpu_id, node_id,
/// mm_cid), at `rseq`.
fn assert_same_memory(x: i32, b: i32, rseq: u64) {
    let cpu_fields = [rseq..rseq + 8, rseq + 24..rseq + 32];
    let (xm, bm) = (read_maps(x).expect("maps"), read_maps(b).expect("maps"));
    let (xs, bs) = (shape(&xm), shape(&bm));
    let only_x: Vec<_> = xs.iter().filter(|v| !bs.contains(v)).collect();
    let only_b: Vec<_> = bs.iter().filter(|v| !xs.contains(v)).collect();
    assert!(
        only_x.is_empty() && only_b.is_empty(),
        "layouts of X and B: only in X {only_x:x?}, only in B {only_b:x?}"
    );
    let (xf, bf) = (
        File::open(format!("/proc/{x}/mem")).expect("mem"),
        File::open(format!("/proc/{b}/mem")).expect("mem"),
    );
    for v in bm.iter().filter(|v| v.prot & libc::PROT_READ != 0) {
        if v.name.starts_with("[vvar") || v.name == "[vsyscall]" {
            continue;
        }
        let mut page_b = vec![0u8; 4096];
        let mut page_x = vec![0u8; 4096];
        for addr in (v.start..v.end).step_by(4096) {
            bf.read_exact_at(&mut page_b, addr)
                .unwrap_or_else(|e| panic!("read B {addr:#x} ({}): {e}", v.name));
            xf.read_exact_at(&mut page_x, addr)
                .unwrap_or_else(|e| panic!("read X {addr:#x} ({}): {e}", v.name));
            let diff: Vec<usize> = (0..4096)
                .filter(|i| page_b[*i] != page_x[*i])
                .filter(|i| !cpu_fields.iter().any(|r| r.contains(&(addr + *i as u64))))
                .collect();
            assert!(
                diff.is_empty(),
                "page {addr:#x} of {} differs at {diff:?}",
                v.name
            );
        }
    }
}

/// Rebuild a fork of A's clone into B; returns (X's pid, stats, B's pid, the
/// lines the scenario printed until B was stopped).
fn rebuild_case(
    sc: &mut Scenario,
    stdio: [&std::os::fd::OwnedFd; 3],
) -> (i32, RebuildStats, i32, Vec<String>) {
    let b_line = expect_line(&sc.lines, "b-ready ", Duration::from_secs(20));
    let b: i32 = b_line
        .split_whitespace()
        .nth(1)
        .and_then(|w| w.parse().ok())
        .expect("b pid");
    let shell = sc.shell();
    let forked = sc.fork(shell, stdio, None).expect("remote_fork");
    let mut g = Tracee::seize_and_interrupt(forked.pid).expect("seize G");
    g.wait_stopped(Duration::from_secs(2)).expect("G stops");
    let mut x = fork_stopped(&mut g).expect("fork X");
    g.detach().expect("detach G");
    let mut bt = Tracee::seize_and_interrupt(b).expect("seize B");
    bt.wait_stopped(Duration::from_secs(2)).expect("B stops");
    // B prints nothing more while stopped; let the reader thread catch up.
    std::thread::sleep(Duration::from_millis(100));
    let printed: Vec<String> = sc.lines.try_iter().collect();
    let mut shared = SharedObjects::default();
    let stats = make_like(&mut x, &mut shared, sc.template, &bt).expect("rebuild");
    println!("  {stats:?}");
    let b_regs = *bt.original_regs().expect("B's registers");
    // SAFETY: reading a constant glibc exports (the same glibc as B's: B runs this
    // binary, or Python on the same libc).
    let offset = unsafe { __rseq_offset };
    assert_same_memory(
        x.pid(),
        b,
        b_regs.fs_base.wrapping_add_signed(offset as i64),
    );
    let xpid = x.pid();
    resume_with(&mut x, b_regs);
    x.detach().expect("detach X");
    bt.detach().expect("detach B");
    (xpid, stats, b, printed)
}

fn rebuild_forked() {
    let mut sc = Scenario::start("rebuild");
    let p = sc.template;
    let null = dev_null();
    // B answers on A's listener (A only waits).
    let first = ask(p, "get");
    assert!(first.starts_with("count=0 "), "{first}");
    let sum = first.split_once(' ').expect("sum").1.to_string();
    assert_eq!(ask(p, "get"), format!("count=1 {sum}"));
    let (x, stats, b, _) = rebuild_case(&mut sc, [&null, &null, &null]);
    assert!(stats.unmapped > 0 && stats.mapped > 0, "{stats:?}");
    assert_eq!(stats.pages_dropped, 4, "the pages B dropped: {stats:?}");
    assert!(
        stats.pages_kept > 2000,
        "A's unchanged pages stay shared: {stats:?}"
    );
    // B wrote about 525 pages (2.1 MB of new heap, 9 pages elsewhere) and its
    // stack: only those are written, not the whole mappings around them.
    assert!(stats.pages_written < 600, "{stats:?}");
    // Only what differs is private to X: the pages written, the new shared
    // object only X maps, and the page of its rseq area (the kernel writes it
    // when the area is unregistered and registered again).
    let private_kb: u64 = read_smaps(x)
        .expect("smaps")
        .iter()
        .map(|v| v.private_dirty_kb)
        .sum();
    let expected_kb = stats.pages_written * 4 + stats.shared_bytes_copied / 1024;
    assert!(
        stats.shared_bytes_copied > 0 && private_kb <= expected_kb + 8,
        "X's private memory {private_kb} kB for {expected_kb} kB written: {stats:?}"
    );
    // B's shared memory (made after the fork, and shared with A) is the clone's
    // own in X.
    let (xs, bs) = (objects(x, "/dev/zero"), objects(b, "/dev/zero"));
    assert_eq!(xs.len(), 2, "two shared anonymous objects in X: {xs:?}");
    assert!(xs.iter().all(|o| !bs.contains(o)), "X {xs:?}, B {bs:?}");
    // X continues as B, answering on the clone's listener, with B's memory.
    let init = sc.shell_ref(0).init;
    assert_eq!(ask(init, "get"), format!("count=2 {sum}"));
    assert_eq!(ask(p, "get"), format!("count=2 {sum}"));
    assert_eq!(ask(init, "get"), format!("count=3 {sum}"));
    assert_eq!(ask(init, "get"), format!("count=4 {sum}"));
    assert_eq!(ask(p, "get"), format!("count=3 {sum}"));
    kill_and_wait_dead(x);
    kill_and_wait_dead(b);
}

fn rebuild_exec() {
    let mut sc = Scenario::start("rebuild-exec");
    let null = dev_null();
    let (out_r, out_w) = pipe();
    let (x, stats, b, printed) = rebuild_case(&mut sc, [&null, &out_w, &null]);
    assert!(
        stats.exe_changed && stats.unmapped > 0 && stats.mapped > 0,
        "{stats:?}"
    );
    assert_eq!(
        std::fs::read_link(format!("/proc/{x}/exe")).expect("exe"),
        std::fs::read_link(format!("/proc/{b}/exe")).expect("exe")
    );
    // B's last count before it was stopped; X continues from it.
    let last: u64 = printed
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("count "))
        .map_or(0, |n| n.parse().expect("count"));
    let lines = roles::line_channel(File::from(out_r));
    let count = |line: String| -> u64 { line["count ".len()..].parse().expect("count") };
    let first = count(expect_line(&lines, "count ", Duration::from_secs(5)));
    assert!(
        last > 0 && first == last + 1,
        "X continues B's count: B at {last}, X at {first}"
    );
    for n in 1..20 {
        assert_eq!(
            count(expect_line(&lines, "count ", Duration::from_secs(5))),
            first + n
        );
    }
    kill_and_wait_dead(x);
    kill_and_wait_dead(b);
}

/// Kill a process whose parent does not reap it (X's parent is the paused clone
/// of A, B's is A) and wait until it is dead.
fn kill_and_wait_dead(pid: i32) {
    // SAFETY: kill with plain integers.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    wait_until("the process to die", Duration::from_secs(5), || {
        let state = status_field(pid, "State");
        state.is_empty() || state.starts_with('Z')
    });
}

fn partly_attached() {
    let mut sc = Scenario::start("memory-partial");
    let p = sc.template;
    let _cleanup = Cleanup(
        sc.ready["shm"].clone(),
        sc.ready["shmid"].parse().expect("shmid"),
    );
    // `who`: the pid the error must name (0: the clone's process, not known here).
    let refused = |err: RemoteError, who: i32| match err {
        RemoteError::UnsupportedMapping {
            pid, name, reason, ..
        } => {
            if who != 0 {
                assert_eq!(pid, who);
            }
            assert!(name.starts_with("/SYSV"), "{name}");
            assert!(reason.contains("in part"), "{reason}");
        }
        other => panic!("unexpected error {other}"),
    };
    let err = ensure_memory_clonable(p).expect_err("must refuse");
    println!("  {err}");
    refused(err, p);
    // The fork is refused too, leaving nothing in the shell.
    let shell = sc.shell();
    let init = sc.shell_ref(shell).init;
    let null = dev_null();
    refused(
        sc.fork(shell, [&null, &null, &null], None)
            .expect_err("must refuse"),
        0,
    );
    wait_until("the half-made clone to go", Duration::from_secs(3), || {
        processes_in_pidns_of(init).len() == 1
    });
    assert_all(&ask(p, "inc"), 1, "template");
    // A template without such a mapping passes the check.
    let ok = Scenario::start("memory");
    let _cleanup_ok = Cleanup(
        ok.ready["shm"].clone(),
        ok.ready["shmid"].parse().expect("shmid"),
    );
    ensure_memory_clonable(ok.template).expect("clonable");
}

/// A traced process killed meanwhile (its box stopped while a checkpoint had
/// it stopped) leaves nothing to detach from: the detach succeeds, and the
/// process's end is handed on to its parent.
fn killed_tracee() {
    let mut child = std::process::Command::new("sleep")
        .arg("1000")
        .spawn()
        .expect("spawn sleep");
    let pid = child.id() as i32;
    // Its state letter, `None` once it is gone.
    let state = || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .next()
            .map(String::from)
    };
    let t = Tracee::seize_and_interrupt(pid).expect("seize");
    // SAFETY: kill with plain integers.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    wait_until("the tracee to die", Duration::from_secs(5), || {
        state().is_none_or(|s| s == "Z")
    });
    t.detach().expect("detaching from a killed tracee");
    // Its tracer saw its end (and, being its parent here too, reaped it);
    // nothing of it is left.
    let _ = child.try_wait();
    wait_until(
        "the killed tracee to be reaped",
        Duration::from_secs(5),
        || state().is_none(),
    );
}
