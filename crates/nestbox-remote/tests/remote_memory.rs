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

use nestbox_remote::maps::read_maps;
use nestbox_remote::FdAction;

use scenario::*;

fn main() {
    if let Ok(role) = std::env::var(roles::ROLE) {
        let memory = std::env::var("NBR_MODE").is_ok_and(|m| m.split(',').any(|x| x == "memory"));
        if role == "template" && memory {
            memory_roles::memory_template();
        }
        roles::run(&role);
    }
    let cases: &[(&str, fn())] = &[("shared_memory_is_private_to_the_clone", shared_private)];
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
    for name in ["anon", "memfd", "shm", "file", "sysv", "only"] {
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
        assert_eq!(c.len(), 1, "clone: one object for {needle}: {c:?}");
        if needle == "/SYSV" {
            // A segment's inode is its id, which the clone's segment keeps.
            assert_eq!(t, c, "same segment id");
        } else {
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
