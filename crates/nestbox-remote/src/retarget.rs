//! Re-targeting the template's fds in the forked process, before it enters the
//! clone's pid namespace: each fd gets the treatment of its row in the clone fd
//! matrix (`docs/clone-fds.md`), by injected syscalls, so that nothing writable
//! stays shared with the template.
//!
//! New objects are created on a free fd number and moved onto the template's
//! number with `dup3`, keeping its close-on-exec flag; epoll instances are rebuilt
//! last, once the fds they watch have been re-targeted. Connected objects
//! (pipes, socket pairs) go through [`CloneObjects`], outside connections
//! become [`placeholder`]s, and a pidfd of the template process itself is
//! opened again in the clone's process ([`own_pidfds`]), which exists only
//! after the last fork.

use serde::Serialize;

use crate::batch::Batch;
use crate::error::Result;
use crate::fdinfo::{FdAction, FdEntry, FdKind, InotifyWatch, SocketInfo};
use crate::memory::Scratch;
use crate::objects::CloneObjects;
use crate::placeholder::{self, TcpResets};
use crate::tracee::Tracee;

/// What was done with one fd of the template in the clone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FdOutcome {
    /// The fd number (the same in the clone).
    pub fd: i32,
    /// What it was in the template (`/proc/PID/fd` link text).
    pub target: String,
    /// What happened to it.
    pub action: FdAction,
}

/// File status flags that `open` takes and that survive in fdinfo's `flags`.
const REOPEN_FLAGS: i32 = libc::O_ACCMODE
    | libc::O_APPEND
    | libc::O_NONBLOCK
    | libc::O_DSYNC
    | libc::O_SYNC
    | libc::O_DIRECT
    | libc::O_NOATIME
    | libc::O_LARGEFILE;

struct Ctx<'a> {
    tracee: &'a mut Tracee,
    scratch: &'a mut Scratch,
    /// New objects made at a free number, to be moved onto their fd (`dup3`
    /// with the template's close-on-exec flag, then `close`): all in one
    /// batch ([`Ctx::flush_moves`]), each move a round trip less. The last
    /// field says whether the source is closed after it (not the clone's
    /// stdio fds, which serve 0, 1 and 2 and are closed by their owner).
    moves: Vec<(u64, i32, u64, bool)>,
}

impl Ctx<'_> {
    fn call(&mut self, name: &'static str, fd: i32, nr: i64, args: &[u64]) -> Result<u64> {
        self.tracee
            .syscall(name, || format!("for fd {fd}"), nr, args)
    }

    /// Move `tmp` onto `entry`'s fd (keeping the template's close-on-exec
    /// flag) and close it, at the next [`Ctx::flush_moves`]; meanwhile the
    /// fd still holds what the fork gave it.
    fn install(&mut self, tmp: u64, entry: &FdEntry) -> Result<()> {
        let cloexec = (entry.flags & libc::O_CLOEXEC) as u64;
        self.moves.push((tmp, entry.fd, cloexec, true));
        Ok(())
    }

    /// Make the moves of [`Ctx::install`], in one batch.
    fn flush_moves(&mut self) -> Result<()> {
        let mut batch = Batch::new();
        for (tmp, fd, cloexec, close) in self.moves.drain(..) {
            batch.push(
                "dup3",
                format!("for fd {fd}"),
                libc::SYS_dup3,
                &[tmp, fd as u64, cloexec],
            );
            if close {
                batch.push("close", format!("for fd {fd}"), libc::SYS_close, &[tmp]);
            }
        }
        self.scratch.reset();
        batch.run(self.tracee, self.scratch)?;
        Ok(())
    }

    fn nonblock(entry: &FdEntry) -> i32 {
        entry.flags & libc::O_NONBLOCK
    }

    fn reopen(&mut self, entry: &FdEntry, path: &str) -> Result<()> {
        self.scratch.reset();
        let addr = self.scratch.put_path(self.tracee, path.as_bytes())?;
        let flags = (entry.flags & REOPEN_FLAGS) | libc::O_CLOEXEC;
        let tmp = self.tracee.syscall(
            "openat",
            || format!("reopening {path} for fd {}", entry.fd),
            libc::SYS_openat,
            &[libc::AT_FDCWD as u64, addr, flags as u64, 0],
        )?;
        if entry.pos != 0 {
            self.call(
                "lseek",
                entry.fd,
                libc::SYS_lseek,
                &[tmp, entry.pos, libc::SEEK_SET as u64],
            )?;
        }
        self.install(tmp, entry)
    }

    fn setsockopt(&mut self, fd: i32, tmp: u64, level: i32, name: i32, value: i32) -> Result<()> {
        self.scratch.reset();
        let addr = self.scratch.put(self.tracee, &value.to_ne_bytes())?;
        self.call(
            "setsockopt",
            fd,
            libc::SYS_setsockopt,
            &[tmp, level as u64, name as u64, addr, 4],
        )?;
        Ok(())
    }

    fn socket(&mut self, entry: &FdEntry, sock: &SocketInfo) -> Result<()> {
        let fd = entry.fd;
        let mut ty = sock.sock_type | libc::SOCK_CLOEXEC;
        if Self::nonblock(entry) != 0 {
            ty |= libc::SOCK_NONBLOCK;
        }
        let tmp = self.call(
            "socket",
            fd,
            libc::SYS_socket,
            &[sock.domain as u64, ty as u64, sock.protocol as u64],
        )?;
        let sol = libc::SOL_SOCKET;
        for (on, name) in [
            (sock.reuseaddr, libc::SO_REUSEADDR),
            (sock.reuseport, libc::SO_REUSEPORT),
            (sock.keepalive, libc::SO_KEEPALIVE),
            (sock.broadcast, libc::SO_BROADCAST),
        ] {
            if on {
                self.setsockopt(fd, tmp, sol, name, 1)?;
            }
        }
        if let Some(v6only) = sock.v6only {
            self.setsockopt(
                fd,
                tmp,
                libc::IPPROTO_IPV6,
                libc::IPV6_V6ONLY,
                i32::from(v6only),
            )?;
        }
        if sock.nodelay == Some(true) {
            self.setsockopt(fd, tmp, libc::IPPROTO_TCP, libc::TCP_NODELAY, 1)?;
        }
        // A connected UDP socket is not bound again: its local address may be
        // the template's own (the clone has another), and `connect` chooses one.
        let inet = sock.domain != libc::AF_UNIX;
        if sock.is_bound() && !(inet && sock.connected) {
            if let Some(path) = sock.unix_path() {
                self.scratch.reset();
                let addr = self.scratch.put_path(self.tracee, path)?;
                let shown = String::from_utf8_lossy(path).into_owned();
                let unlinked = self.tracee.syscall(
                    "unlinkat",
                    || format!("stale socket {shown} for fd {fd}"),
                    libc::SYS_unlinkat,
                    &[libc::AT_FDCWD as u64, addr, 0],
                );
                match unlinked {
                    Err(e) if e.errno() == Some(libc::ENOENT) => {}
                    other => {
                        other?;
                    }
                }
            }
            self.scratch.reset();
            let addr = self.scratch.put(self.tracee, &sock.local)?;
            self.call(
                "bind",
                fd,
                libc::SYS_bind,
                &[tmp, addr, sock.local.len() as u64],
            )?;
        }
        if sock.listening {
            let backlog = sock.backlog.unwrap_or(libc::SOMAXCONN);
            self.call("listen", fd, libc::SYS_listen, &[tmp, backlog as u64])?;
        }
        if sock.connected && !sock.peer_addr.is_empty() {
            // A connected datagram socket: connected again to the same peer,
            // from the clone's network namespace.
            self.scratch.reset();
            let addr = self.scratch.put(self.tracee, &sock.peer_addr)?;
            self.call(
                "connect",
                fd,
                libc::SYS_connect,
                &[tmp, addr, sock.peer_addr.len() as u64],
            )?;
        }
        self.install(tmp, entry)
    }

    fn placeholder(
        &mut self,
        template_pid: i32,
        entry: &FdEntry,
        sock: &SocketInfo,
        resets: &mut Option<TcpResets>,
    ) -> Result<()> {
        let tmp = if sock.domain == libc::AF_UNIX {
            placeholder::unix(self.tracee, self.scratch, template_pid, entry, sock)?
        } else {
            let resets = match resets {
                Some(resets) => resets,
                None => resets.insert(TcpResets::open(self.tracee, self.scratch)?),
            };
            resets.make(self.tracee, self.scratch, entry.fd)?
        };
        let status = Self::nonblock(entry) as u64;
        if status != 0 {
            self.call(
                "fcntl(F_SETFL)",
                entry.fd,
                libc::SYS_fcntl,
                &[tmp as u64, libc::F_SETFL as u64, status],
            )?;
        }
        self.install(tmp as u64, entry)
    }

    /// A new inotify instance with the same watches at the same watch
    /// descriptors: wds are allocated in increasing order (cyclically) within
    /// an instance, so a gap before a wd is skipped by adding and removing a
    /// watch on the first watched path as often as needed; the `IN_IGNORED`
    /// events that leaves are read out before the fd is installed.
    fn inotify(&mut self, entry: &FdEntry, watches: &[InotifyWatch]) -> Result<()> {
        let fd = entry.fd;
        let tmp = self.call(
            "inotify_init1",
            fd,
            libc::SYS_inotify_init1,
            &[(libc::IN_CLOEXEC | libc::IN_NONBLOCK) as u64],
        )?;
        let mut next = 1;
        let mut skipped = false;
        for watch in watches {
            let path = watch.path.as_deref().unwrap_or("/");
            self.scratch.reset();
            let addr = self.scratch.put_path(self.tracee, path.as_bytes())?;
            while next < watch.wd {
                // A watch of its own inode gets the next wd; removed at once.
                let filler = self.tracee.syscall(
                    "inotify_add_watch",
                    || format!("filling wd {next} for fd {fd}"),
                    libc::SYS_inotify_add_watch,
                    &[tmp, addr, (libc::IN_ATTRIB | libc::IN_DONT_FOLLOW) as u64],
                )? as i32;
                self.tracee.syscall(
                    "inotify_rm_watch",
                    || format!("filling wd {next} for fd {fd}"),
                    libc::SYS_inotify_rm_watch,
                    &[tmp, filler as u64],
                )?;
                skipped = true;
                next = filler + 1;
            }
            let wd = self.tracee.syscall(
                "inotify_add_watch",
                || format!("watch {} of {path} for fd {fd}", watch.wd),
                libc::SYS_inotify_add_watch,
                // The path names the watched inode itself, a symlink included.
                &[tmp, addr, u64::from(watch.mask | libc::IN_DONT_FOLLOW)],
            )? as i32;
            if wd != watch.wd {
                return Err(crate::RemoteError::Injected {
                    syscall: "inotify_add_watch",
                    pid: self.tracee.pid(),
                    context: format!(
                        "watch of {path} for fd {fd} got wd {wd} instead of {} (is that file watched twice?)",
                        watch.wd
                    ),
                    source: std::io::Error::from_raw_os_error(libc::EEXIST),
                });
            }
            next = wd + 1;
        }
        if skipped {
            self.scratch.reset();
            let buf = self.scratch.reserve(4096)?;
            loop {
                let (rax, _) = self.tracee.inject_raw(libc::SYS_read, &[tmp, buf, 4096])?;
                if rax <= 0 {
                    break;
                }
            }
        }
        let status = Self::nonblock(entry) as u64;
        self.call(
            "fcntl(F_SETFL)",
            fd,
            libc::SYS_fcntl,
            &[tmp, libc::F_SETFL as u64, status],
        )?;
        self.install(tmp, entry)
    }

    /// Every eventfd, timerfd and signalfd of `entries` re-created: made in
    /// one batch, then given their counts and timers in a second (none with
    /// nothing to set), each installed on its number at the next
    /// [`Ctx::flush_moves`]. (Two resumes of the process instead of one or
    /// two per fd: each resume is a ptrace round trip.)
    fn counters(&mut self, entries: &[(&FdEntry, &FdKind)]) -> Result<()> {
        if entries.is_empty() {
            return Ok(());
        }
        // The signal masks in the scratch area first, the table after them.
        self.scratch.reset();
        let mut make = Batch::new();
        for (entry, kind) in entries {
            let context = format!("for fd {}", entry.fd);
            let nonblock = Self::nonblock(entry);
            match kind {
                FdKind::EventFd { count, semaphore } => {
                    let mut flags = libc::EFD_CLOEXEC | nonblock;
                    if *semaphore {
                        flags |= libc::EFD_SEMAPHORE;
                    }
                    let initial = u32::try_from(*count).unwrap_or(0);
                    make.push(
                        "eventfd2",
                        context,
                        libc::SYS_eventfd2,
                        &[u64::from(initial), flags as u64],
                    );
                }
                FdKind::TimerFd { clockid, .. } => make.push(
                    "timerfd_create",
                    context,
                    libc::SYS_timerfd_create,
                    &[*clockid as u64, (libc::TFD_CLOEXEC | nonblock) as u64],
                ),
                FdKind::SignalFd { mask } => {
                    let addr = self.scratch.put(self.tracee, &mask.to_ne_bytes())?;
                    make.push(
                        "signalfd4",
                        context,
                        libc::SYS_signalfd4,
                        &[u64::MAX, addr, 8, (libc::SFD_CLOEXEC | nonblock) as u64],
                    );
                }
                _ => unreachable!("counters() is given eventfds, timerfds and signalfds only"),
            }
        }
        let made = make.run(self.tracee, self.scratch)?;
        self.scratch.reset();
        let mut set = Batch::new();
        for ((entry, kind), &tmp) in entries.iter().zip(&made) {
            let context = format!("for fd {}", entry.fd);
            match kind {
                // A count above what eventfd2 takes is written.
                FdKind::EventFd { count, .. } if u32::try_from(*count).is_err() => {
                    let addr = self.scratch.put(self.tracee, &count.to_ne_bytes())?;
                    set.push("write", context, libc::SYS_write, &[tmp, addr, 8]);
                }
                FdKind::TimerFd {
                    ticks,
                    value,
                    interval,
                    ..
                } => {
                    // Expirations not yet read cannot be carried over as a
                    // count: arm the timer to expire at once so that a read
                    // still succeeds.
                    let value = if *ticks > 0 { (0, 1) } else { *value };
                    if value != (0, 0) {
                        let mut spec = Vec::with_capacity(32);
                        for v in [interval.0, interval.1, value.0, value.1] {
                            spec.extend_from_slice(&v.to_ne_bytes());
                        }
                        let addr = self.scratch.put(self.tracee, &spec)?;
                        set.push(
                            "timerfd_settime",
                            context,
                            libc::SYS_timerfd_settime,
                            &[tmp, 0, addr, 0],
                        );
                    }
                }
                _ => {}
            }
        }
        set.run(self.tracee, self.scratch)?;
        for ((entry, _), &tmp) in entries.iter().zip(&made) {
            self.install(tmp, entry)?;
        }
        Ok(())
    }

    /// Every epoll of `entries` re-created with its registrations: the epolls
    /// made in one batch, every registration in a second (the fds they watch
    /// are on their final numbers by then), each installed at the next
    /// [`Ctx::flush_moves`].
    fn epolls(&mut self, entries: &[&FdEntry]) -> Result<()> {
        if entries.is_empty() {
            return Ok(());
        }
        self.scratch.reset();
        let mut make = Batch::new();
        for entry in entries {
            make.push(
                "epoll_create1",
                format!("for fd {}", entry.fd),
                libc::SYS_epoll_create1,
                &[libc::EPOLL_CLOEXEC as u64],
            );
        }
        let made = make.run(self.tracee, self.scratch)?;
        // The events in the scratch area first, the batch's table after them.
        self.scratch.reset();
        let mut register = Batch::new();
        for (entry, &tmp) in entries.iter().zip(&made) {
            let FdKind::Epoll(watches) = &entry.kind else {
                continue;
            };
            for watch in watches {
                // packed struct epoll_event on x86_64: u32 events, u64 data.
                let mut event = Vec::with_capacity(12);
                event.extend_from_slice(&watch.events.to_ne_bytes());
                event.extend_from_slice(&watch.data.to_ne_bytes());
                let addr = self.scratch.put(self.tracee, &event)?;
                register.push(
                    "epoll_ctl(EPOLL_CTL_ADD)",
                    format!("epoll fd {} watching fd {}", entry.fd, watch.fd),
                    libc::SYS_epoll_ctl,
                    &[tmp, libc::EPOLL_CTL_ADD as u64, watch.fd as u64, addr],
                );
            }
        }
        register.run(self.tracee, self.scratch)?;
        for (entry, &tmp) in entries.iter().zip(&made) {
            self.install(tmp, entry)?;
        }
        Ok(())
    }
}

/// Apply the fd matrix in `tracee` (a fork of template process `template_pid`
/// that has joined the clone's mount and network namespaces). `stdio` are the
/// clone's stdio fds as installed in `tracee`. For a process tree, `objects`
/// is the table planned over every template process
/// ([`CloneObjects::plan`]) and whether `tracee` is the process that creates
/// them (the first one re-targeted; the others get the same objects handed
/// over). `None`: the objects of `entries` alone, created here.
pub(crate) fn retarget_with(
    tracee: &mut Tracee,
    scratch: &mut Scratch,
    template_pid: i32,
    entries: &[FdEntry],
    stdio: [i32; 3],
    objects: Option<(&mut CloneObjects, bool)>,
) -> Result<Vec<FdOutcome>> {
    let actions: Vec<FdAction> = entries.iter().map(FdEntry::action).collect();
    // Pass 1: pidfds of the process itself are closed (opened again in the
    // clone's process, see own_pidfds); pass 2: connected objects; pass 3:
    // placeholders, reopen and re-create (except epoll); pass 4: stdio;
    // pass 5: epoll, which needs the final targets of the fds it watches.
    for entry in entries {
        // (A pidfd of another process of the box stays until box_pidfds
        // replaces it, keeping its number taken meanwhile.)
        if matches!(entry.kind, FdKind::PidFd { own: true, .. }) {
            tracee.syscall(
                "close",
                || format!("for fd {}", entry.fd),
                libc::SYS_close,
                &[entry.fd as u64],
            )?;
        }
    }
    let mut own = CloneObjects::plan(&[(template_pid, entries)]);
    let (objects, creator) = match objects {
        Some(shared) => shared,
        None => (&mut own, true),
    };
    if creator && !objects.is_empty() {
        objects.create(tracee, scratch)?;
    }
    objects.install(tracee, scratch, template_pid, creator)?;
    if creator {
        objects.close_in_creator(tracee, scratch)?;
    }
    let mut ctx = Ctx {
        tracee,
        scratch,
        moves: Vec::new(),
    };
    let mut resets = None;
    // Clients of the box's Unix datagram servers connect once those exist.
    let mut clients = Vec::new();
    let counters: Vec<(&FdEntry, &FdKind)> = entries
        .iter()
        .zip(&actions)
        .filter(|(e, a)| {
            **a == FdAction::Recreate
                && matches!(
                    e.kind,
                    FdKind::EventFd { .. } | FdKind::TimerFd { .. } | FdKind::SignalFd { .. }
                )
        })
        .map(|(e, _)| (e, &e.kind))
        .collect();
    ctx.counters(&counters)?;
    for (entry, action) in entries.iter().zip(&actions) {
        match (action, &entry.kind) {
            (FdAction::Recreate, FdKind::Socket(sock))
                if sock.domain == libc::AF_UNIX && sock.connected =>
            {
                clients.push((entry, sock))
            }
            (FdAction::Reopen, FdKind::File { path, .. }) => ctx.reopen(entry, path)?,
            (FdAction::Placeholder, FdKind::Socket(sock)) => {
                ctx.placeholder(template_pid, entry, sock, &mut resets)?
            }
            (FdAction::Recreate, FdKind::Socket(sock)) => ctx.socket(entry, sock)?,
            (FdAction::Recreate, FdKind::Inotify(watches)) => ctx.inotify(entry, watches)?,
            _ => {}
        }
    }
    if let Some(resets) = resets {
        resets.close(ctx.tracee)?;
    }
    for (entry, sock) in clients {
        ctx.socket(entry, sock)?;
    }
    // Every object made so far onto its number, and the stdio, in one batch.
    for (entry, action) in entries.iter().zip(&actions) {
        if *action == FdAction::Stdio {
            let cloexec = (entry.flags & libc::O_CLOEXEC) as u64;
            ctx.moves
                .push((stdio[entry.fd as usize] as u64, entry.fd, cloexec, false));
        }
    }
    ctx.flush_moves()?;
    let epolls: Vec<&FdEntry> = entries
        .iter()
        .zip(&actions)
        .filter(|(e, a)| **a == FdAction::Recreate && matches!(e.kind, FdKind::Epoll(_)))
        .map(|(e, _)| e)
        .collect();
    ctx.epolls(&epolls)?;
    ctx.flush_moves()?;
    Ok(entries
        .iter()
        .zip(actions)
        .map(|(entry, action)| FdOutcome {
            fd: entry.fd,
            target: entry.target.clone(),
            action,
        })
        .collect())
}

/// In the clone's process (in the clone's pid namespace): a pidfd of itself at
/// each fd where the template had a pidfd of itself, with its `O_NONBLOCK`
/// (`PIDFD_NONBLOCK`) and close-on-exec flags.
pub(crate) fn own_pidfds(tracee: &mut Tracee, entries: &[FdEntry]) -> Result<()> {
    let own: Vec<&FdEntry> = entries
        .iter()
        .filter(|e| matches!(e.kind, FdKind::PidFd { own: true, .. }))
        .collect();
    if own.is_empty() {
        return Ok(());
    }
    let me = tracee.syscall("getpid", String::new, libc::SYS_getpid, &[])?;
    for entry in own {
        pidfd_at(tracee, entry, me)?;
    }
    Ok(())
}

/// In a clone's process, once every process of the clone exists: a pidfd of
/// the clone's process with pid `ns_pid` at each fd where the template had a
/// pidfd of another process of its box (`pidfd_open` resolves the pid in the
/// clone's pid namespace, where the pids are the template's).
pub(crate) fn box_pidfds(tracee: &mut Tracee, entries: &[FdEntry]) -> Result<()> {
    for entry in entries {
        if let FdKind::PidFd {
            ns_pid,
            own: false,
            in_box: true,
            ..
        } = entry.kind
        {
            pidfd_at(tracee, entry, ns_pid as u64)?;
        }
    }
    Ok(())
}

/// A pidfd of `pid` (in `tracee`'s pid namespace) at `entry`'s fd number, with
/// its `O_NONBLOCK` (`PIDFD_NONBLOCK`) and close-on-exec flags.
fn pidfd_at(tracee: &mut Tracee, entry: &FdEntry, pid: u64) -> Result<()> {
    let fd = entry.fd;
    let flags = (entry.flags & libc::O_NONBLOCK) as u64;
    let tmp = tracee.syscall(
        "pidfd_open",
        || format!("pidfd of the clone's pid {pid} for fd {fd}"),
        libc::SYS_pidfd_open,
        &[pid, flags],
    )?;
    if tmp == fd as u64 {
        // The number was free (closed in the first process): it got it.
        let cloexec = u64::from(entry.flags & libc::O_CLOEXEC != 0);
        tracee.syscall(
            "fcntl(F_SETFD)",
            || format!("for fd {fd}"),
            libc::SYS_fcntl,
            &[tmp, libc::F_SETFD as u64, cloexec],
        )?;
        return Ok(());
    }
    move_onto(tracee, tmp, entry)
}

/// Move the new object at fd `tmp` of `tracee` onto `entry`'s number (with
/// its close-on-exec flag) and close `tmp`.
pub(crate) fn move_onto(tracee: &mut Tracee, tmp: u64, entry: &FdEntry) -> Result<()> {
    let fd = entry.fd;
    let cloexec = (entry.flags & libc::O_CLOEXEC) as u64;
    tracee.syscall(
        "dup3",
        || format!("for fd {fd}"),
        libc::SYS_dup3,
        &[tmp, fd as u64, cloexec],
    )?;
    tracee.syscall("close", || format!("for fd {fd}"), libc::SYS_close, &[tmp])?;
    Ok(())
}
