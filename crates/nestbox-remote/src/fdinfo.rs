//! The fd inventory of a process: what each open fd is (from `/proc/PID/fd`,
//! `/proc/PID/fdinfo` and, for sockets, a tracer-side duplicate taken with
//! `pidfd_getfd`), and which rule of the clone fd matrix applies to it
//! (`docs/clone-fds.md`).

use std::ffi::OsStr;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;

use serde::Serialize;

use crate::error::{RemoteError, Result};
use crate::procfs::{proc_path, read_to_string};

/// One registration of an epoll instance (`tfd:` line of its fdinfo).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct EpollWatch {
    /// The registered fd number.
    pub fd: i32,
    /// The event mask, including `EPOLLET`/`EPOLLONESHOT`/... bits.
    pub events: u32,
    /// The user data.
    pub data: u64,
    /// Inode of the registered file, to check `fd` still refers to it.
    pub ino: u64,
}

/// A socket's identity and the options the clone's copy gets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct SocketInfo {
    /// `SO_DOMAIN`.
    pub domain: i32,
    /// `SO_TYPE` (without `SOCK_NONBLOCK`/`SOCK_CLOEXEC`).
    pub sock_type: i32,
    /// `SO_PROTOCOL`.
    pub protocol: i32,
    /// `SO_ACCEPTCONN`.
    pub listening: bool,
    /// `getpeername` succeeds.
    pub connected: bool,
    /// `getsockname`, raw `sockaddr` bytes (empty if unbound).
    pub local: Vec<u8>,
    /// `SO_REUSEADDR`.
    pub reuseaddr: bool,
    /// `SO_REUSEPORT`.
    pub reuseport: bool,
    /// `SO_KEEPALIVE`.
    pub keepalive: bool,
    /// `SO_BROADCAST`.
    pub broadcast: bool,
    /// `IPV6_V6ONLY` (AF_INET6 only).
    pub v6only: Option<bool>,
    /// `TCP_NODELAY` (TCP only).
    pub nodelay: Option<bool>,
    /// Listen backlog, when the kernel tells it (TCP: `TCP_INFO`).
    pub backlog: Option<i32>,
    /// `getpeername`, raw `sockaddr` bytes (empty if not connected).
    pub peer_addr: Vec<u8>,
    /// Inode of the socket (`socket:[INO]`).
    pub ino: u64,
    /// Connected Unix sockets: the peer's inode (`UNIX_DIAG_PEER` of sock_diag);
    /// `Some(0)` when the peer was closed; `None` for other sockets.
    pub peer: Option<u64>,
    /// The peer is a socket of the box connected back to this one (both ends
    /// held by the box's processes): set by [`inspect_fds`] for one process and
    /// by [`crate::mark_peers_inside`] for several.
    pub peer_inside: bool,
    /// A datagram socket connected to a socket of the box that is not
    /// connected back (a bound server): set with `peer_inside`.
    pub peer_bound_inside: bool,
    /// Connected Unix sockets: data queued for it carries fds (`SCM_RIGHTS`),
    /// which no clone can copy (seen with `MSG_PEEK`, the queue untouched).
    pub fds_in_flight: bool,
}

impl SocketInfo {
    /// Whether the socket has a local address worth re-binding.
    pub fn is_bound(&self) -> bool {
        match self.domain {
            libc::AF_INET => self.local.len() >= 4 && self.local[2..4] != [0, 0],
            libc::AF_INET6 => self.local.len() >= 4 && self.local[2..4] != [0, 0],
            libc::AF_UNIX => self.local.len() > 2,
            _ => false,
        }
    }

    /// The bound path of a Unix socket (not abstract, not unnamed).
    pub fn unix_path(&self) -> Option<&[u8]> {
        if self.domain != libc::AF_UNIX || self.local.len() <= 2 || self.local[2] == 0 {
            return None;
        }
        let path = &self.local[2..];
        Some(path.split(|b| *b == 0).next().unwrap_or(path))
    }
}

/// What an fd is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub enum FdKind {
    /// A regular file (also a memfd, or an `O_PATH` fd on anything).
    File {
        /// Path as `/proc/PID/fd` shows it, without the " (deleted)" suffix.
        path: String,
        /// Unlinked file (or memfd).
        deleted: bool,
    },
    /// A directory.
    Directory,
    /// A character device.
    CharDevice,
    /// A block device.
    BlockDevice,
    /// A pipe or FIFO.
    Pipe,
    /// A socket.
    Socket(SocketInfo),
    /// An epoll instance with its registrations.
    Epoll(Vec<EpollWatch>),
    /// An eventfd.
    EventFd {
        /// Current counter.
        count: u64,
        /// `EFD_SEMAPHORE`.
        semaphore: bool,
    },
    /// A timerfd, with the time left (relative) and its interval.
    TimerFd {
        /// Clock.
        clockid: i32,
        /// Expirations not yet read.
        ticks: u64,
        /// Time to the next expiration, (seconds, nanoseconds); zero: disarmed.
        value: (u64, u64),
        /// Interval, (seconds, nanoseconds).
        interval: (u64, u64),
    },
    /// A signalfd and the signals it reads (bit `n-1` for signal `n`).
    SignalFd {
        /// Signal mask.
        mask: u64,
    },
    /// An inotify instance and its watches.
    Inotify(Vec<InotifyWatch>),
    /// A pidfd.
    PidFd {
        /// The process's pid as the tracer sees it (`Pid:`; -1: it ended).
        pid: i32,
        /// Its pid in its innermost pid namespace (last of `NSpid:`).
        ns_pid: i32,
        /// It is the inspected process itself.
        own: bool,
        /// It is another process of the same box (set over a whole box's
        /// inventories by [`mark_pidfds_inside`]).
        in_box: bool,
    },
    /// Anything else (fanotify, io_uring, userfaultfd, ...).
    Other,
}

/// One watch of an inotify instance (`inotify wd:` line of its fdinfo).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct InotifyWatch {
    /// Watch descriptor.
    pub wd: i32,
    /// Event mask as given to `inotify_add_watch` (the kernel's internal bits
    /// above `IN_ALL_EVENTS`, e.g. `IN_ONESHOT`, included as shown).
    pub mask: u32,
    /// Inode of the watched file.
    pub ino: u64,
    /// Device of the watched file (kernel encoding: major << 20 | minor).
    pub sdev: u64,
    /// The watched file's path in the template's mount namespace, found from
    /// its file handle (`open_by_handle_at`); `None` when it could not be.
    pub path: Option<String>,
}

/// What happens to an fd in a clone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub enum FdAction {
    /// The clone shares the open file description with the template.
    Shared,
    /// Reopened by path in the clone's root with the same flags and offset.
    Reopen,
    /// Replaced by the stdio fd the caller gives for the clone (fds 0, 1, 2).
    Stdio,
    /// A new object of the same kind is created in the clone with the same state.
    Recreate,
    /// Closed in the clone.
    Close,
    /// A memfd or deleted file open for writing: the clone gets a new object with
    /// a copy of its contents (the same new object its mappings get), made in the
    /// clone's final process (`shmem.rs`).
    CopyShared,
    /// One end of a new connected object (pipe, FIFO, Unix socket pair or
    /// connection inside the box): the clone's ends are connected as the
    /// template's, with the data buffered in them copied (`crate::objects`).
    Pair,
    /// A connection to outside the box: a placeholder on the same number that
    /// fails reads and writes as a reset connection would.
    Placeholder,
    /// No rule: the clone is refused.
    Unsupported(String),
}

impl fmt::Display for FdAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FdAction::Shared => f.write_str("shared"),
            FdAction::Reopen => f.write_str("reopened"),
            FdAction::Stdio => f.write_str("replaced by the clone's stdio"),
            FdAction::Recreate => f.write_str("re-created"),
            FdAction::Close => f.write_str("closed"),
            FdAction::CopyShared => f.write_str("copied to a new object"),
            FdAction::Pair => f.write_str("re-created as a new connected object"),
            FdAction::Placeholder => f.write_str("a reset placeholder"),
            FdAction::Unsupported(why) => write!(f, "unsupported: {why}"),
        }
    }
}

/// One open fd of a process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct FdEntry {
    /// The fd number.
    pub fd: i32,
    /// The `/proc/PID/fd/N` link text (`socket:[123]`, `anon_inode:[eventfd]`, a path).
    pub target: String,
    /// Open flags from fdinfo, with `O_CLOEXEC` if the fd is close-on-exec.
    pub flags: i32,
    /// File position.
    pub pos: u64,
    /// Inode number.
    pub ino: u64,
    /// What it is.
    pub kind: FdKind,
    /// An fd 0–2 that is not the box's stdio but an object of the box (in a
    /// process tree, a pipe to another process of it, say): then it follows
    /// the rule of its kind, not [`FdAction::Stdio`]. Set by [`mark_stdio`].
    #[serde(default)]
    pub not_box_stdio: bool,
}

impl FdEntry {
    /// Whether the fd was opened for writing.
    pub fn writable(&self) -> bool {
        self.flags & libc::O_PATH == 0 && self.flags & libc::O_ACCMODE != libc::O_RDONLY
    }

    /// The rule of the clone fd matrix for this fd.
    pub fn action(&self) -> FdAction {
        if (0..=2).contains(&self.fd) && !self.not_box_stdio {
            return FdAction::Stdio;
        }
        if self.flags & libc::O_PATH != 0 {
            return FdAction::Shared;
        }
        match &self.kind {
            FdKind::File { deleted, path } => {
                if !self.writable() {
                    FdAction::Shared
                } else if *deleted || path.starts_with("/dev/shm/") {
                    // (A clone's /dev/shm is a tmpfs of its own, empty: the
                    // file is made there with the template's contents.)
                    FdAction::CopyShared
                } else if !path.starts_with('/') {
                    FdAction::Unsupported(
                        "a file open for writing that has no path cannot be reopened in the clone".into(),
                    )
                } else {
                    FdAction::Reopen
                }
            }
            FdKind::Directory | FdKind::CharDevice | FdKind::BlockDevice => FdAction::Shared,
            FdKind::Pipe => FdAction::Pair,
            FdKind::Socket(sock) => match sock.domain {
                libc::AF_UNIX if sock.fds_in_flight => FdAction::Unsupported(
                    "data buffered in it carries fds (SCM_RIGHTS), which a clone cannot copy"
                        .into(),
                ),
                libc::AF_UNIX if sock.connected && (sock.peer_inside || sock.peer == Some(0)) => {
                    FdAction::Pair
                }
                // A client of a datagram server of the box: connected again
                // to the server's (re-created) address.
                libc::AF_UNIX if sock.connected && sock.peer_bound_inside && sock.peer_addr.len() > 2 => {
                    FdAction::Recreate
                }
                libc::AF_INET | libc::AF_INET6
                    if sock.connected && sock.sock_type == libc::SOCK_DGRAM =>
                {
                    FdAction::Recreate
                }
                libc::AF_INET | libc::AF_INET6 | libc::AF_UNIX if sock.connected => {
                    FdAction::Placeholder
                }
                // A TCP connection that ended (reset: no peer any more) keeps
                // its local address: it was a connection, and its address (the
                // template's, or a listener's port) cannot be bound again.
                libc::AF_INET | libc::AF_INET6
                    if sock.sock_type == libc::SOCK_STREAM
                        && !sock.listening
                        && sock.local.get(2..4).is_some_and(|port| port != [0, 0]) =>
                {
                    FdAction::Placeholder
                }
                libc::AF_INET | libc::AF_INET6 | libc::AF_UNIX => FdAction::Recreate,
                other => FdAction::Unsupported(format!(
                    "sockets of address family {other} have no clone rule (only AF_INET, AF_INET6, AF_UNIX)"
                )),
            },
            FdKind::EventFd { .. } | FdKind::TimerFd { .. } | FdKind::SignalFd { .. } => {
                FdAction::Recreate
            }
            FdKind::Epoll(watches) => match watches.iter().find(|w| w.fd == self.fd) {
                Some(_) => FdAction::Unsupported("an epoll instance watching itself".into()),
                None => FdAction::Recreate,
            },
            FdKind::Inotify(watches) => match watches.iter().find(|w| w.path.is_none()) {
                Some(w) => FdAction::Unsupported(format!(
                    "the file of its watch {} (inode {:#x}) has no path the clone could watch again",
                    w.wd, w.ino
                )),
                None => FdAction::Recreate,
            },
            FdKind::PidFd { own: true, .. } | FdKind::PidFd { in_box: true, .. } => {
                FdAction::Recreate
            }
            FdKind::PidFd { pid: -1, .. } => FdAction::Unsupported(
                "a pidfd of a process that has ended, which the clone has no copy of".into(),
            ),
            FdKind::PidFd { pid, ns_pid, .. } => FdAction::Unsupported(format!(
                "a pidfd of another process (pid {pid}, {ns_pid} in its namespace), which the clone has no copy of"
            )),
            FdKind::Other => FdAction::Unsupported(format!(
                "{} has no clone rule (fanotify, io_uring, userfaultfd and other special fds cannot be cloned)",
                self.target
            )),
        }
    }
}

/// The inventory of `pid`'s open fds, sorted by number.
pub fn inspect_fds(pid: i32) -> Result<Vec<FdEntry>> {
    let dir = proc_path(pid, "fd");
    let read_dir = std::fs::read_dir(&dir).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound => RemoteError::NoSuchProcess { pid },
        _ => RemoteError::Proc {
            path: dir.clone(),
            source,
        },
    })?;
    let mut fds: Vec<i32> = read_dir
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse().ok()))
        .collect();
    fds.sort_unstable();
    let mut pidfd: Option<OwnedFd> = None;
    let mut out = Vec::with_capacity(fds.len());
    for fd in fds {
        match inspect_one(pid, fd, &mut pidfd) {
            Ok(entry) => out.push(entry),
            // Closed between the directory listing and now.
            Err(RemoteError::Proc { source, .. }) if source.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    resolve_unix_peers(pid, &mut out)?;
    mark_peers_inside(&mut [&mut out[..]]);
    Ok(out)
}

/// Fill in the peer inode of every connected Unix socket of `entries` (fds of
/// `pid`), from sock_diag in `pid`'s network namespace.
pub(crate) fn resolve_unix_peers(pid: i32, entries: &mut [FdEntry]) -> Result<()> {
    let connected_unix = |e: &FdEntry| matches!(&e.kind, FdKind::Socket(s) if s.domain == libc::AF_UNIX && s.connected);
    if !entries.iter().any(connected_unix) {
        return Ok(());
    }
    let peers = crate::unixdiag::peers(pid)?;
    for entry in entries.iter_mut() {
        if let FdKind::Socket(sock) = &mut entry.kind {
            if sock.domain == libc::AF_UNIX && sock.connected {
                sock.peer = Some(peers.get(&sock.ino).copied().unwrap_or(0));
            }
        }
    }
    Ok(())
}

/// Mark the connected Unix sockets whose peer is held by one of the given
/// processes' fds and connected back (`SocketInfo::peer_inside`), or is a
/// socket of theirs not connected back (`peer_bound_inside`): the
/// inventories of all the processes of a box, so that a connection between two
/// of them is re-created as a pair and any other as a placeholder.
pub fn mark_peers_inside(processes: &mut [&mut [FdEntry]]) {
    let mut peer_of = std::collections::HashMap::new();
    for entries in processes.iter() {
        for entry in entries.iter() {
            if let FdKind::Socket(s) = &entry.kind {
                peer_of.insert(s.ino, s.peer.unwrap_or(0));
            }
        }
    }
    for entries in processes.iter_mut() {
        for entry in entries.iter_mut() {
            if let FdKind::Socket(s) = &mut entry.kind {
                let peer = s.peer.unwrap_or(0);
                let peers_peer = (peer != 0).then(|| peer_of.get(&peer)).flatten();
                s.peer_inside = peers_peer == Some(&s.ino);
                s.peer_bound_inside =
                    s.sock_type == libc::SOCK_DGRAM && !s.peer_inside && peers_peer.is_some();
            }
        }
    }
}

/// Over the inventories of a box's processes, the first being its main
/// process (whose fds 0–2 are the box's stdio: the monitor's pipes, a
/// terminal, a file), mark each other process's fd 0–2 that is not one of
/// those objects (its `/proc/PID/fd` target differs from all three) as
/// [`FdEntry::not_box_stdio`]: a command whose output is piped to another
/// process of the box keeps that pipe in a clone, where only what wrote to
/// the box's own stdio writes to the clone's.
pub fn mark_stdio(processes: &mut [&mut [FdEntry]]) {
    let Some((main, others)) = processes.split_first_mut() else {
        return;
    };
    let box_stdio: Vec<&str> = main
        .iter()
        .filter(|e| (0..=2).contains(&e.fd))
        .map(|e| e.target.as_str())
        .collect();
    for entries in others.iter_mut() {
        for entry in entries.iter_mut() {
            if (0..=2).contains(&entry.fd) {
                entry.not_box_stdio = !box_stdio.contains(&entry.target.as_str());
            }
        }
    }
}

/// Mark the pidfds that refer to a process of the box (`host_pids`, the
/// box's processes but its init): in a clone they refer to the clone's
/// process with the same pid.
pub fn mark_pidfds_inside(processes: &mut [&mut [FdEntry]], host_pids: &[i32]) {
    for entries in processes.iter_mut() {
        for entry in entries.iter_mut() {
            if let FdKind::PidFd { pid, in_box, .. } = &mut entry.kind {
                *in_box = host_pids.contains(pid);
            }
        }
    }
}

/// Re-read the entries whose state changes while the process is frozen (timerfd
/// time left and expirations, eventfd counter), so that an inventory taken at
/// freeze time can be reused for each clone.
pub fn refresh_volatile(pid: i32, entries: &mut [FdEntry]) -> Result<()> {
    let mut pidfd = None;
    for entry in entries.iter_mut() {
        if matches!(entry.kind, FdKind::TimerFd { .. } | FdKind::EventFd { .. }) {
            *entry = inspect_one(pid, entry.fd, &mut pidfd)?;
        }
    }
    Ok(())
}

/// Refuse an inventory that has an fd without a rule (the first one found).
pub fn ensure_clonable(pid: i32, entries: &[FdEntry]) -> Result<()> {
    for entry in entries {
        let unsupported = |reason: String| RemoteError::UnsupportedFd {
            pid,
            fd: entry.fd,
            kind: entry.target.clone(),
            reason,
        };
        if let FdAction::Unsupported(reason) = entry.action() {
            return Err(unsupported(reason));
        }
        if let (FdAction::Recreate, FdKind::Epoll(watches)) = (entry.action(), &entry.kind) {
            for watch in watches {
                match entries.iter().find(|e| e.fd == watch.fd) {
                    Some(watched) if watched.ino != watch.ino => {
                        return Err(unsupported(format!(
                            "it watches a file that is no longer open at fd {} (inode {:#x})",
                            watch.fd, watch.ino
                        )))
                    }
                    None => {
                        return Err(unsupported(format!(
                            "it watches fd {}, which is closed",
                            watch.fd
                        )))
                    }
                    Some(watched) if matches!(watched.kind, FdKind::Epoll(_)) => {
                        return Err(unsupported(format!(
                            "it watches another epoll instance (fd {}); nested epoll is not cloned",
                            watch.fd
                        )))
                    }
                    Some(_) => {}
                }
            }
        }
    }
    Ok(())
}

fn inspect_one(pid: i32, fd: i32, pidfd: &mut Option<OwnedFd>) -> Result<FdEntry> {
    let link = proc_path(pid, &format!("fd/{fd}"));
    let target = std::fs::read_link(&link).map_err(|source| RemoteError::Proc {
        path: link.clone(),
        source,
    })?;
    let target_bytes = target.as_os_str().as_bytes();
    let target = String::from_utf8_lossy(target_bytes).into_owned();
    let info_path = proc_path(pid, &format!("fdinfo/{fd}"));
    let info = read_to_string(&info_path)?;
    let field = |name: &str| -> Option<&str> {
        info.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(':')))
            .map(str::trim)
    };
    let bad = |message: String| RemoteError::Parse {
        path: info_path.clone(),
        message,
    };
    let flags = i32::from_str_radix(field("flags").unwrap_or("0"), 8)
        .map_err(|_| bad("flags is not octal".into()))?;
    let pos: u64 = field("pos").unwrap_or("0").parse().unwrap_or(0);
    let ino: u64 = field("ino").and_then(|s| s.parse().ok()).unwrap_or(0);

    let kind = if let Some(anon) = target.strip_prefix("anon_inode:") {
        match anon {
            "[eventpoll]" => FdKind::Epoll(parse_epoll(&info).map_err(bad)?),
            "[eventfd]" => FdKind::EventFd {
                count: u64::from_str_radix(field("eventfd-count").unwrap_or("0"), 16)
                    .map_err(|_| bad("eventfd-count is not hexadecimal".into()))?,
                semaphore: field("eventfd-semaphore") == Some("1"),
            },
            "[timerfd]" => FdKind::TimerFd {
                clockid: field("clockid")
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| bad("no clockid".into()))?,
                ticks: field("ticks").and_then(|s| s.parse().ok()).unwrap_or(0),
                value: parse_pair(field("it_value")).ok_or_else(|| bad("bad it_value".into()))?,
                interval: parse_pair(field("it_interval"))
                    .ok_or_else(|| bad("bad it_interval".into()))?,
            },
            "[signalfd]" => FdKind::SignalFd {
                mask: u64::from_str_radix(field("sigmask").unwrap_or(""), 16)
                    .map_err(|_| bad("sigmask is not hexadecimal".into()))?,
            },
            "inotify" => FdKind::Inotify(crate::inotify::parse_watches(pid, &info).map_err(bad)?),
            "[pidfd]" => {
                let of = field("Pid")
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| bad("no Pid".into()))?;
                let ns_pid = field("NSpid")
                    .and_then(|s| s.split_whitespace().last())
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(of);
                FdKind::PidFd {
                    pid: of,
                    ns_pid,
                    own: of == pid,
                    in_box: false,
                }
            }
            _ => FdKind::Other,
        }
    } else if target.starts_with("socket:") {
        let mut sock = inspect_socket(pid, fd, pidfd)?;
        sock.ino = ino;
        FdKind::Socket(sock)
    } else if target.starts_with("pipe:") {
        FdKind::Pipe
    } else if target.starts_with('/') {
        let meta = std::fs::metadata(&link).map_err(|source| RemoteError::Proc {
            path: link.clone(),
            source,
        })?;
        let ft = meta.file_type();
        if ft.is_dir() {
            FdKind::Directory
        } else if ft.is_char_device() {
            FdKind::CharDevice
        } else if ft.is_block_device() {
            FdKind::BlockDevice
        } else if ft.is_fifo() {
            FdKind::Pipe
        } else if ft.is_file() || flags & libc::O_PATH != 0 {
            let (path, deleted) = match target.strip_suffix(" (deleted)") {
                Some(p) => (p.to_string(), true),
                None => (target.clone(), target.starts_with("/memfd:")),
            };
            FdKind::File { path, deleted }
        } else {
            FdKind::Other
        }
    } else {
        FdKind::Other
    };
    Ok(FdEntry {
        fd,
        target: if target_bytes.is_empty() {
            OsStr::new("?").to_string_lossy().into_owned()
        } else {
            target
        },
        flags,
        pos,
        ino,
        kind,
        not_box_stdio: false,
    })
}

fn parse_pair(text: Option<&str>) -> Option<(u64, u64)> {
    let inner = text?.trim().strip_prefix('(')?.strip_suffix(')')?;
    let (a, b) = inner.split_once(',')?;
    Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
}

fn parse_epoll(info: &str) -> std::result::Result<Vec<EpollWatch>, String> {
    let mut out = Vec::new();
    for line in info.lines().filter(|l| l.starts_with("tfd:")) {
        let tokens: Vec<&str> = line.split_whitespace().collect();
        let value = |key: &str| -> Option<&str> {
            tokens
                .iter()
                .position(|t| *t == key)
                .and_then(|i| tokens.get(i + 1).copied())
        };
        let inline =
            |key: &str| -> Option<&str> { tokens.iter().find_map(|t| t.strip_prefix(key)) };
        let bad = || format!("bad epoll line {line:?}");
        out.push(EpollWatch {
            fd: value("tfd:").and_then(|s| s.parse().ok()).ok_or_else(bad)?,
            events: value("events:")
                .and_then(|s| u32::from_str_radix(s, 16).ok())
                .ok_or_else(bad)?,
            data: value("data:")
                .and_then(|s| u64::from_str_radix(s, 16).ok())
                .ok_or_else(bad)?,
            ino: inline("ino:")
                .and_then(|s| u64::from_str_radix(s, 16).ok())
                .ok_or_else(bad)?,
        });
    }
    Ok(out)
}

/// `pidfd_open(pid)`.
pub(crate) fn pidfd_open(pid: i32) -> Result<OwnedFd> {
    nestbox_sys::pidfd::pidfd_open(pid).map_err(|e| RemoteError::Sys {
        op: "pidfd_open",
        pid,
        source: e.into(),
    })
}

/// `pidfd_getfd(pidfd, fd)`: a duplicate of another process's fd in ours.
pub(crate) fn pidfd_getfd(pidfd: &OwnedFd, pid: i32, fd: i32) -> Result<OwnedFd> {
    nestbox_sys::pidfd::pidfd_getfd(pidfd.as_fd(), fd).map_err(|e| RemoteError::Sys {
        op: "pidfd_getfd",
        pid,
        source: e.into(),
    })
}

fn getsockopt_int(fd: &OwnedFd, level: i32, name: i32) -> io::Result<i32> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: value/len are valid out-pointers sized for an int option.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            name,
            std::ptr::addr_of_mut!(value).cast(),
            &mut len,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(value)
    }
}

fn sockname(
    fd: &OwnedFd,
    call: unsafe extern "C" fn(
        libc::c_int,
        *mut libc::sockaddr,
        *mut libc::socklen_t,
    ) -> libc::c_int,
) -> io::Result<Vec<u8>> {
    // A plain byte buffer of sockaddr_storage's size: the kernel copies the
    // address into it byte by byte, so neither alignment nor padding matters.
    let mut bytes = vec![0u8; std::mem::size_of::<libc::sockaddr_storage>()];
    let mut len = bytes.len() as libc::socklen_t;
    // SAFETY: `bytes`/`len` describe a writable buffer large enough for any
    // address; the kernel writes at most `len` bytes and updates `len`.
    let rc = unsafe { call(fd.as_raw_fd(), bytes.as_mut_ptr().cast(), &mut len) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    bytes.truncate((len as usize).min(bytes.len()));
    Ok(bytes)
}

fn inspect_socket(pid: i32, fd: i32, pidfd: &mut Option<OwnedFd>) -> Result<SocketInfo> {
    if pidfd.is_none() {
        *pidfd = Some(pidfd_open(pid)?);
    }
    let pidfd = pidfd.as_ref().ok_or(RemoteError::NoSuchProcess { pid })?;
    let sock = pidfd_getfd(pidfd, pid, fd)?;
    let opt = |level: i32, name: i32, op: &'static str| -> Result<i32> {
        getsockopt_int(&sock, level, name).map_err(|source| RemoteError::Sys { op, pid, source })
    };
    let domain = opt(libc::SOL_SOCKET, libc::SO_DOMAIN, "getsockopt(SO_DOMAIN)")?;
    let sock_type = opt(libc::SOL_SOCKET, libc::SO_TYPE, "getsockopt(SO_TYPE)")?;
    let protocol = opt(
        libc::SOL_SOCKET,
        libc::SO_PROTOCOL,
        "getsockopt(SO_PROTOCOL)",
    )?;
    let listening = opt(
        libc::SOL_SOCKET,
        libc::SO_ACCEPTCONN,
        "getsockopt(SO_ACCEPTCONN)",
    )? != 0;
    let flag = |level: i32, name: i32| {
        getsockopt_int(&sock, level, name)
            .map(|v| v != 0)
            .unwrap_or(false)
    };
    let inet = domain == libc::AF_INET || domain == libc::AF_INET6;
    let tcp = inet && sock_type == libc::SOCK_STREAM && protocol == libc::IPPROTO_TCP;
    let local = sockname(&sock, libc::getsockname).unwrap_or_default();
    let peer_addr = sockname(&sock, libc::getpeername);
    let connected = peer_addr.is_ok();
    let backlog = if tcp && listening {
        tcp_listen_backlog(&sock)
    } else {
        None
    };
    Ok(SocketInfo {
        domain,
        sock_type,
        protocol,
        listening,
        connected,
        local,
        reuseaddr: flag(libc::SOL_SOCKET, libc::SO_REUSEADDR),
        reuseport: flag(libc::SOL_SOCKET, libc::SO_REUSEPORT),
        keepalive: flag(libc::SOL_SOCKET, libc::SO_KEEPALIVE),
        broadcast: flag(libc::SOL_SOCKET, libc::SO_BROADCAST),
        v6only: (domain == libc::AF_INET6).then(|| flag(libc::IPPROTO_IPV6, libc::IPV6_V6ONLY)),
        nodelay: tcp.then(|| flag(libc::IPPROTO_TCP, libc::TCP_NODELAY)),
        backlog,
        fds_in_flight: if domain == libc::AF_UNIX && connected {
            crate::buffered::queue_carries_fds(&sock, sock_type).map_err(|source| {
                RemoteError::Sys {
                    op: "recvmsg(MSG_PEEK) of a Unix socket's queue",
                    pid,
                    source,
                }
            })?
        } else {
            false
        },
        peer_addr: peer_addr.unwrap_or_default(),
        ino: 0,
        peer: None,
        peer_inside: false,
        peer_bound_inside: false,
    })
}

/// For a listening TCP socket, `TCP_INFO` reports the backlog in `tcpi_sacked`.
fn tcp_listen_backlog(sock: &OwnedFd) -> Option<i32> {
    // SAFETY: tcp_info is plain data; zeroed is valid.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: info/len describe a tcp_info-sized buffer.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            std::ptr::addr_of_mut!(info).cast(),
            &mut len,
        )
    };
    (rc == 0 && info.tcpi_state == 10/* TCP_LISTEN */).then_some(info.tcpi_sacked as i32)
}
