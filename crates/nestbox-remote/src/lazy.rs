//! Lazy restore: a restored process runs before its private anonymous
//! memory is filled. The rebuild engine maps that memory empty
//! ([`crate::rebuild::PageSource::defer`]); the process gets a userfaultfd
//! in missing-page mode over it, and a page server of its own serves every
//! fault on a page of the image with `UFFDIO_COPY` (a page the image does not
//! hold with a zero page) while it copies every remaining page in, in the
//! background. Once every page of the image is in, the server closes the
//! userfaultfd: the kernel unregisters the memory, and what was never
//! written reads as zeros, which is what the image says of those pages.
//!
//! The userfaultfd is created by the process itself (the one code of
//! dirty.rs, [`crate::dirty::inject_userfaultfd`]), without
//! `UFFD_USER_MODE_ONLY` so that a fault in a system call (a `read(2)`
//! into an untouched buffer) is served too, which needs the process to hold
//! `CAP_SYS_PTRACE` of the initial user namespace: a process restored in a
//! box of its own user namespace cannot, and is filled at once (the eager
//! path). It reports forks (the child's memory gets a userfaultfd of its
//! own, served from the same image: a missing page of the child is one the
//! parent had not received either), `mremap`, `munmap` and `madvise`
//! drops, so that a page is never put where the process has since moved,
//! dropped or unmapped it.
//!
//! The server is a process of its own (forked from the restorer before the
//! restored process is released; `setsid`), so it outlives the `restore`
//! command. If it ended before every page is in, the kernel would fill the
//! rest with zeros: so a guardian, forked by the server, holds a copy of the
//! userfaultfd and a pipe from it. When the pipe closes without the
//! server's "done" (the server was killed, or failed: a page that does not
//! match its digest), the guardian kills the box's init (the whole box
//! goes; a fault waiting meanwhile never returns to the process) and only
//! then lets the userfaultfd go. A server that fails kills the box itself
//! first. Both log with tracing (the runtime points it at the box's monitor
//! log while it restores lazily). A process forked by the restored one while the server runs has a
//! userfaultfd the server alone holds; if the server is killed, that child
//! may read a zero page in the moment before the guardian's kill.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use nestbox_sys::uffd::{self, Filled, UffdMsg};
use nix::errno::Errno;

use crate::dirty::inject_userfaultfd;
use crate::error::{RemoteError, Result};
use crate::maps::PAGE;
use crate::procimage::PageStore;
use crate::rebuild::{write_deferred, Layout, PageSource};
use crate::tracee::Tracee;

/// Pages copied in one `UFFDIO_COPY` of the background fill (the server
/// looks for faults between two).
const RUN: usize = 16;
/// Pages put in at a fault: the faulting one and those after it.
const FAULT_RUN: usize = 16;

/// The events the server follows (see the module documentation).
const FEATURES: u64 = uffd::UFFD_FEATURE_EVENT_FORK
    | uffd::UFFD_FEATURE_EVENT_REMAP
    | uffd::UFFD_FEATURE_EVENT_REMOVE
    | uffd::UFFD_FEATURE_EVENT_UNMAP;

/// What a lazy restore needs besides the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LazyPlan {
    /// Host pid of the restored box's init: killed (and the whole box with
    /// it) when the page server fails or ends before every page is in.
    pub box_init: i32,
}

/// A page server started by a lazy restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LazyServer {
    /// Its host pid (it forked its guardian).
    pub pid: i32,
    /// Pages of the image it puts in.
    pub pages: usize,
}

/// The pages of one address space still to put in: current address →
/// the address the image holds the page at (they differ once the process
/// moved memory with `mremap`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Remaining(BTreeMap<u64, u64>);

impl Remaining {
    /// Every page of `ranges` the image holds (`held`: its addresses,
    /// sorted).
    pub(crate) fn of(ranges: &[(u64, u64)], held: &[u64]) -> Remaining {
        let mut map = BTreeMap::new();
        for &(s, e) in ranges {
            let from = held.partition_point(|a| *a < s);
            for &addr in held[from..].iter().take_while(|a| **a < e) {
                map.insert(addr, addr);
            }
        }
        Remaining(map)
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    /// Take the page at `addr` out: the image's address of it.
    fn take(&mut self, addr: u64) -> Option<u64> {
        self.0.remove(&addr)
    }

    /// `[start, end)` was unmapped or dropped: nothing is to be put there.
    fn forget(&mut self, start: u64, end: u64) {
        let gone: Vec<u64> = self.0.range(start..end).map(|(k, _)| *k).collect();
        for k in gone {
            self.0.remove(&k);
        }
    }

    /// `[from, from + len)` moved to `to`.
    fn moved(&mut self, from: u64, to: u64, len: u64) {
        let moved: Vec<(u64, u64)> = self
            .0
            .range(from..from.saturating_add(len))
            .map(|(k, v)| (*k, *v))
            .collect();
        for (k, _) in &moved {
            self.0.remove(k);
        }
        for (k, v) in moved {
            self.0.insert(k - from + to, v);
        }
    }

    /// The first run of consecutive pages, at most `max`: (current, image's).
    fn first_run(&self, max: usize) -> Vec<(u64, u64)> {
        self.run_from(0, max)
    }

    /// The run of consecutive pages left from the first at or after `at`,
    /// at most `max`.
    fn run_from(&self, at: u64, max: usize) -> Vec<(u64, u64)> {
        let mut run: Vec<(u64, u64)> = Vec::with_capacity(max);
        for (k, v) in self.0.range(at..) {
            if run.len() == max || run.last().is_some_and(|(last, _)| last + PAGE != *k) {
                break;
            }
            run.push((*k, *v));
        }
        run
    }
}

/// One address space the server fills.
struct Space {
    uffd: OwnedFd,
    remaining: Remaining,
}

/// What the server did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Served {
    faults: u64,
    zero_faults: u64,
    copied: u64,
    forks: u64,
}

/// After the rebuild of `x` (held) deferred `deferred` of `target`: give it
/// a userfaultfd over them and start the page server, or, when the process
/// cannot have one, write them now. Returns the server when the restore is
/// lazy.
/// `options` are the ptrace options `x` is traced with.
///
/// # Errors
/// A failed write of the pages (eager), or a page server that did not start.
pub(crate) fn start(
    x: &mut Tracee,
    target: &Layout,
    deferred: &[(u64, u64)],
    store: &dyn PageStore,
    source: &dyn PageSource,
    plan: &LazyPlan,
    options: libc::c_int,
) -> Result<Option<LazyServer>> {
    let pid = x.pid();
    let flags = (libc::O_CLOEXEC | libc::O_NONBLOCK) as u64;
    let registered = inject_userfaultfd(x, flags, options).and_then(|fd| {
        let err = |op| {
            move |e: Errno| RemoteError::Sys {
                op,
                pid,
                source: e.into(),
            }
        };
        uffd::enable_missing(fd.as_fd(), FEATURES).map_err(err(
            "UFFDIO_API (missing pages, fork/remap/remove/unmap events)",
        ))?;
        for &(s, e) in deferred {
            uffd::register_missing(fd.as_fd(), s, e - s)
                .map_err(err("UFFDIO_REGISTER (missing pages)"))?;
        }
        Ok(fd)
    });
    let fd = match registered {
        Ok(fd) => fd,
        Err(e) => {
            tracing::info!(pid, "lazy restore not possible, pages written now: {e}");
            write_deferred(x, target, deferred, source)?;
            return Ok(None);
        }
    };
    crate::marks::mark("lazy: userfaultfd registered");
    let remaining = Remaining::of(deferred, &store.held());
    let pages = remaining.len();
    crate::marks::mark("lazy: pages to serve listed");
    let server = spawn_server(fd, remaining, store, plan.box_init, pid)?;
    crate::marks::mark("lazy: page server ready");
    Ok(Some(LazyServer { pid: server, pages }))
}

/// Fork the page server (which forks its guardian) and wait until both
/// hold the userfaultfd; ours is then closed.
fn spawn_server(
    fd: OwnedFd,
    remaining: Remaining,
    store: &dyn PageStore,
    box_init: i32,
    pid: i32,
) -> Result<i32> {
    let sys = |op: &'static str| {
        move |e: Errno| RemoteError::Sys {
            op,
            pid,
            source: e.into(),
        }
    };
    let init = nestbox_sys::pidfd::pidfd_open(box_init).map_err(sys("pidfd_open (box init)"))?;
    let (ready_r, ready_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(sys("pipe2 (page server ready)"))?;
    // SAFETY: the child runs only this module's server: plain syscalls,
    // allocation (glibc's fork makes the allocator usable in the child even
    // when another thread of ours was allocating, as the migration
    // receiver's pool thread may be), the page store, which only the
    // forking thread uses, and the diagnostics' lock when it logs a failure
    // (another thread holds that one only while it writes a line of its own
    // failure); it takes no other lock and ends with exit_now.
    let forked =
        unsafe { nestbox_sys::process::fork_with_malloc() }.map_err(sys("fork (page server)"))?;
    match forked {
        nestbox_sys::process::Forked::Child => {
            drop(ready_r);
            let code = server_main(fd, remaining, store, init, ready_w);
            nestbox_sys::process::exit_now(code)
        }
        nestbox_sys::process::Forked::Parent(server) => {
            drop(ready_w);
            drop(fd);
            let mut b = [0u8; 1];
            let n = nix::unistd::read(ready_r.as_raw_fd(), &mut b);
            if n != Ok(1) {
                let _ = nix::sys::signal::kill(server, nix::sys::signal::Signal::SIGKILL);
                let _ = nestbox_sys::process::waitpid_raw(server.as_raw(), 0);
                return Err(RemoteError::Sys {
                    op: "starting the page server (lazy restore)",
                    pid,
                    source: std::io::Error::other("it ended before it was ready"),
                });
            }
            tracing::debug!(
                pid,
                server = server.as_raw(),
                "lazy restore: page server runs"
            );
            Ok(server.as_raw())
        }
    }
}

/// Close every pipe, socket and anonymous-inode fd of ours but `keep`
/// (what a forked server or guardian must not hold: the migration stream,
/// the restorer's pipes), and make stdin and stdout `/dev/null` (stderr,
/// where tracing writes, too when it is a pipe or socket).
fn shed_fds(keep: &[i32]) {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<(i32, String)> = dir
        .flatten()
        .filter_map(|e| {
            let fd: i32 = e.file_name().to_str()?.parse().ok()?;
            let link = std::fs::read_link(e.path()).ok()?;
            Some((fd, link.to_string_lossy().into_owned()))
        })
        .collect();
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null");
    for (fd, link) in fds {
        let channel = link.starts_with("pipe:")
            || link.starts_with("socket:")
            || link.starts_with("anon_inode:");
        if fd <= 2 {
            if let Ok(null) = &null {
                if fd < 2 || channel {
                    // SAFETY: dup2 onto a standard descriptor of ours.
                    unsafe { libc::dup2(null.as_raw_fd(), fd) };
                }
            }
        } else if channel && !keep.contains(&fd) {
            // SAFETY: closing an fd no live Rust object of this (forked)
            // process uses again: the parent's objects are never dropped
            // here (exit_now).
            unsafe { libc::close(fd) };
        }
    }
}

/// The page server: fork the guardian, say ready, serve until every page
/// is in, tell the guardian, wait for it. Its exit code.
fn server_main(
    fd: OwnedFd,
    remaining: Remaining,
    store: &dyn PageStore,
    init: OwnedFd,
    ready: OwnedFd,
) -> i32 {
    let _ = nix::unistd::setsid();
    let (done_r, done_w) = match nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC) {
        Ok(p) => p,
        Err(e) => {
            tracing::error!("lazy restore: page server: pipe2: {e}");
            return 1;
        }
    };
    shed_fds(&[
        fd.as_raw_fd(),
        init.as_raw_fd(),
        ready.as_raw_fd(),
        done_r.as_raw_fd(),
        done_w.as_raw_fd(),
    ]);
    // SAFETY: as for the server: this (single-threaded) process forks a
    // child that runs `guardian` only and ends with exit_now.
    let guardian = match unsafe { nestbox_sys::process::fork_into(nix::sched::CloneFlags::empty()) }
    {
        Ok(nestbox_sys::process::Forked::Child) => {
            drop(done_w);
            drop(ready);
            nestbox_sys::process::exit_now(guardian(done_r, init.as_fd(), &fd))
        }
        Ok(nestbox_sys::process::Forked::Parent(g)) => g,
        Err(e) => {
            tracing::error!("lazy restore: page server: fork (guardian): {e}");
            return 1;
        }
    };
    drop(done_r);
    if nix::unistd::write(&ready, b"r") != Ok(1) {
        // The restorer is gone: it kills the held process; nothing to serve.
        let _ = nix::unistd::write(&done_w, b"d");
        let _ = nestbox_sys::process::waitpid_raw(guardian.as_raw(), 0);
        return 1;
    }
    drop(ready);
    let pages = remaining.len();
    let at = std::time::Instant::now();
    let spaces = vec![Space {
        uffd: fd,
        remaining,
    }];
    match serve(spaces, store) {
        Ok(served) => {
            tracing::debug!(
                pages,
                ?served,
                ms = at.elapsed().as_secs_f64() * 1e3,
                "lazy restore: every page is in"
            );
            let _ = nix::unistd::write(&done_w, b"d");
            let _ = nestbox_sys::process::waitpid_raw(guardian.as_raw(), 0);
            0
        }
        Err(e) => {
            tracing::error!("lazy restore: the page server failed, the box is killed: {e}");
            let _ = nestbox_sys::pidfd::pidfd_send_signal(init.as_fd(), libc::SIGKILL);
            drop(done_w);
            let _ = nestbox_sys::process::waitpid_raw(guardian.as_raw(), 0);
            1
        }
    }
}

/// The guardian: hold the userfaultfd (`_uffd`) until the server says
/// done; if its pipe closes first, kill the box, then let go.
fn guardian(done: OwnedFd, init: BorrowedFd<'_>, _uffd: &OwnedFd) -> i32 {
    let mut b = [0u8; 1];
    loop {
        match nix::unistd::read(done.as_raw_fd(), &mut b) {
            Ok(1) => return 0,
            Err(Errno::EINTR) => continue,
            _ => break,
        }
    }
    tracing::error!(
        "lazy restore: the page server ended before every page was in: the box is killed"
    );
    let _ = nestbox_sys::pidfd::pidfd_send_signal(init, libc::SIGKILL);
    // Let the kernel tear the box down before the userfaultfd goes.
    let _ = nestbox_sys::pidfd::wait_ended(init, Some(std::time::Duration::from_secs(5)));
    1
}

/// Serve faults and events and fill in the background until every space
/// has every page of its image.
fn serve(mut spaces: Vec<Space>, store: &dyn PageStore) -> std::result::Result<Served, String> {
    let mut served = Served::default();
    let mut buf = vec![0u8; RUN.max(FAULT_RUN) * PAGE as usize];
    let mut msgs = Vec::new();
    loop {
        // A space whose pages are all in still gets zero pages at its
        // faults until every space is done: its userfaultfd stays open (the
        // guardian holds a copy of the first), so nobody else would answer.
        if spaces.iter().all(|s| s.remaining.is_empty()) {
            return Ok(served);
        }
        let mut i = 0;
        while i < spaces.len() {
            msgs.clear();
            loop {
                match uffd::read_msgs(spaces[i].uffd.as_fd(), &mut msgs) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(Errno::EINTR) => {}
                    Err(e) => return Err(format!("reading the userfaultfd: {e}")),
                }
            }
            for m in msgs.drain(..) {
                if let Some(child) = handle(&mut spaces[i], m, store, &mut buf, &mut served)? {
                    spaces.push(child);
                }
            }
            i += 1;
        }
        let Some(space) = spaces.iter_mut().find(|s| !s.remaining.is_empty()) else {
            continue;
        };
        if !fill_run(space, store, &mut buf, &mut served)? {
            // The address space is changing: its event comes; wait for it.
            let mut pfd = [libc::pollfd {
                fd: space.uffd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            // SAFETY: one live pollfd of ours.
            unsafe { libc::poll(pfd.as_mut_ptr(), 1, 1) };
        }
    }
}

/// Handle one message of `space`: a fault gets its page, an event updates
/// what is left to put; a fork gives a new space.
fn handle(
    space: &mut Space,
    msg: UffdMsg,
    store: &dyn PageStore,
    buf: &mut [u8],
    served: &mut Served,
) -> std::result::Result<Option<Space>, String> {
    match msg {
        UffdMsg::PageFault { address } => {
            let page = address & !(PAGE - 1);
            served.faults += 1;
            let filled = if space.remaining.0.contains_key(&page) {
                // The page and the ones after it the image holds (a program
                // touches its memory in runs): fewer faults.
                let run = space.remaining.run_from(page, FAULT_RUN);
                copy_run(space, &run, store, buf, served)?
            } else {
                served.zero_faults += 1;
                uffd::zeropage(space.uffd.as_fd(), page, PAGE)
            };
            match filled {
                Filled::Bytes(_) => {}
                // Filled meanwhile; changing (retried by the fill or the
                // thread's next fault); gone.
                Filled::Failed(Errno::EEXIST | Errno::EAGAIN | Errno::ENOENT) => {}
                Filled::Failed(Errno::ESRCH) => space.remaining.0.clear(),
                Filled::Failed(e) => return Err(format!("filling page {page:#x}: {e}")),
            }
            Ok(None)
        }
        UffdMsg::Fork { ufd } => {
            served.forks += 1;
            // SAFETY: the kernel installed this descriptor in our table for
            // this message; nothing else owns it.
            let uffd = unsafe { OwnedFd::from_raw_fd(ufd) };
            Ok(Some(Space {
                uffd,
                remaining: space.remaining.clone(),
            }))
        }
        UffdMsg::Remap { from, to, len } => {
            space.remaining.moved(from, to, len);
            Ok(None)
        }
        UffdMsg::Remove { start, end } | UffdMsg::Unmap { start, end } => {
            space.remaining.forget(start, end);
            Ok(None)
        }
        UffdMsg::Other(e) => Err(format!("unknown userfaultfd event {e:#x}")),
    }
}

/// Copy the first run of pages left in `space`. `false` when the address
/// space is changing (an event is pending).
fn fill_run(
    space: &mut Space,
    store: &dyn PageStore,
    buf: &mut [u8],
    served: &mut Served,
) -> std::result::Result<bool, String> {
    let run = space.remaining.first_run(RUN);
    let Some(&(start, _)) = run.first() else {
        return Ok(true);
    };
    match copy_run(space, &run, store, buf, served)? {
        Filled::Bytes(_) => Ok(true),
        Filled::Failed(Errno::EAGAIN) => Ok(false),
        // The page is there already (the process had it put by other
        // means), or its mapping went without an event we saw yet: nothing
        // to put there.
        Filled::Failed(Errno::EEXIST | Errno::ENOENT | Errno::EINVAL) => {
            space.remaining.take(start);
            Ok(true)
        }
        // The address space is gone (the process exited or exec'd).
        Filled::Failed(Errno::ESRCH) => {
            space.remaining.0.clear();
            Ok(true)
        }
        Filled::Failed(e) => Err(format!("filling {start:#x}: {e}")),
    }
}

/// Read the image's pages of `run` (consecutive, from `space`'s remaining)
/// and put them in with one `UFFDIO_COPY` (its first page alone when the
/// run crosses from one mapping into the next); the pages put in are taken
/// out of what remains.
fn copy_run(
    space: &mut Space,
    run: &[(u64, u64)],
    store: &dyn PageStore,
    buf: &mut [u8],
    served: &mut Served,
) -> std::result::Result<Filled, String> {
    let Some(&(start, _)) = run.first() else {
        return Ok(Filled::Bytes(0));
    };
    for (k, (_, from)) in run.iter().enumerate() {
        let page = &mut buf[k * PAGE as usize..(k + 1) * PAGE as usize];
        store
            .read_page(*from, page)
            .map_err(|e| format!("page {from:#x} of the image: {e}"))?;
    }
    let mut got = uffd::copy(space.uffd.as_fd(), start, &buf[..run.len() * PAGE as usize]);
    if run.len() > 1 && got == Filled::Failed(Errno::ENOENT) {
        // A copy must lie in one mapping: the run crosses into another
        // (the kernel refuses it whole). Its first page alone, then the
        // next run starts in the next mapping.
        got = uffd::copy(space.uffd.as_fd(), start, &buf[..PAGE as usize]);
    }
    if let Filled::Bytes(n) = got {
        let pages = (n / PAGE) as usize;
        for (at, _) in &run[..pages.min(run.len())] {
            space.remaining.take(*at);
        }
        served.copied += pages as u64;
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = PAGE;

    #[test]
    fn remaining_holds_only_image_pages() {
        let held = [0x1000, 0x10000, 0x10000 + 2 * P, 0x10000 + 3 * P, 0x90000];
        let r = Remaining::of(&[(0x10000, 0x10000 + 4 * P)], &held);
        assert_eq!(r.len(), 3);
        assert_eq!(r.first_run(64), vec![(0x10000, 0x10000)]);
    }

    #[test]
    fn runs_are_consecutive_and_bounded() {
        let all: Vec<u64> = (0..16).map(|i| i * P).collect();
        let mut r = Remaining::of(&[(0, 10 * P)], &all);
        assert_eq!(r.first_run(3).len(), 3);
        r.take(P);
        assert_eq!(r.first_run(64), vec![(0, 0)]);
        r.take(0);
        assert_eq!(r.first_run(64).len(), 8);
        assert_eq!(r.first_run(64)[0], (2 * P, 2 * P));
        assert_eq!(r.run_from(5 * P, 2), vec![(5 * P, 5 * P), (6 * P, 6 * P)]);
        assert_eq!(r.run_from(P, 1), vec![(2 * P, 2 * P)]);
    }

    #[test]
    fn moved_pages_keep_their_image_address() {
        let all: Vec<u64> = (0..4).map(|i| 0x1000 + i * P).collect();
        let mut r = Remaining::of(&[(0x1000, 0x1000 + 4 * P)], &all);
        r.moved(0x1000 + P, 0x90000, 2 * P);
        let pages: Vec<(u64, u64)> = r.0.iter().map(|(k, v)| (*k, *v)).collect();
        assert_eq!(
            pages,
            vec![
                (0x1000, 0x1000),
                (0x1000 + 3 * P, 0x1000 + 3 * P),
                (0x90000, 0x1000 + P),
                (0x90000 + P, 0x1000 + 2 * P),
            ]
        );
    }

    #[test]
    fn dropped_and_unmapped_pages_are_forgotten() {
        let all: Vec<u64> = (0..8).map(|i| i * P).collect();
        let mut r = Remaining::of(&[(0, 8 * P)], &all);
        r.forget(2 * P, 5 * P);
        assert_eq!(r.len(), 5);
        assert!(r.take(3 * P).is_none());
        assert_eq!(r.take(5 * P), Some(5 * P));
        r.forget(0, u64::MAX);
        assert!(r.is_empty());
    }
}
