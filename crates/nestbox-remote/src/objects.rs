//! The clone's new connected objects: pipes, FIFOs, Unix socket pairs and Unix
//! connections between fds of the box ([`FdAction::Pair`]), each re-created
//! once and installed at every fd that held the template's object.
//!
//! [`CloneObjects`] is a tracer-side table keyed by the template's object (the
//! pipe's inode; for a Unix connection, the lower inode of its two sockets).
//! Each object is created by injected calls in one forked process, after it
//! joined the clone's namespaces (so a new socket belongs to the clone's
//! network namespace), and the tracer takes a duplicate of each new end with
//! `pidfd_getfd`. It then copies the data buffered in the template's object
//! from a duplicate of the template's fd: `tee(2)` for a pipe (which does not
//! consume it), `MSG_PEEK` reads for a socket (message by message, with
//! `SO_PEEK_OFF` set to 0 and put back as it was), sent again from the other
//! new end ([`crate::buffered`]). The ends are then installed at the template's fd numbers: by
//! `dup3` in the process that created them, and (for process trees) in any
//! other process by handing the tracer's duplicates over with `SCM_RIGHTS`.
//!
//! An end of the template's object that no fd of the box holds (the other end
//! of a pipe held by a process outside the box, a socket whose peer was
//! closed) is closed in the clone: the clone's fds then see what they would
//! see if that end went away (end of file after the buffered data, `EPIPE`).
//! The tracer's duplicates (`made`) must be dropped before any process of the
//! clone runs, or such an end stays open meanwhile.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use crate::batch::Batch;
use crate::buffered::{copy_pipe, copy_queue, CopyError};
use crate::error::{RemoteError, Result};
use crate::fdinfo::{pidfd_getfd, pidfd_open, FdAction, FdEntry, FdKind};
use crate::fdtransfer::install_fds_with;
use crate::memory::Scratch;
use crate::tracee::Tracee;

/// The identity of a template's object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ObjectKey {
    /// A pipe or FIFO, by the inode of the pipe.
    Pipe(u64),
    /// A pair of connected Unix sockets, by the lower of their two inodes.
    Unix(u64),
}

/// One fd of a template process that holds an end of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateEnd {
    /// Host pid of the template process.
    pub pid: i32,
    /// Its fd number.
    pub fd: i32,
    /// Which end: pipe 0 = read, 1 = write; Unix pair: 0 = the lower inode.
    pub side: usize,
    /// The fd's flags (`O_ACCMODE`, `O_NONBLOCK`, `O_CLOEXEC`).
    pub flags: i32,
    /// What it is (`/proc/PID/fd` link text).
    pub target: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Pipe,
    Unix { sock_type: i32 },
}

#[derive(Debug)]
struct Object {
    kind: Kind,
    /// The template's fds on this object, in every process given to the plan.
    ends: Vec<TemplateEnd>,
    /// The new ends, as duplicates held by the tracer.
    made: Option<[OwnedFd; 2]>,
    /// Their numbers in the process that created them, until closed there.
    in_creator: Option<[i32; 2]>,
}

/// The clone's new objects, keyed by the template's (see the module docs).
#[derive(Debug, Default)]
pub struct CloneObjects {
    objects: BTreeMap<ObjectKey, Object>,
    /// No live template to copy buffered data from (a restore): the objects
    /// get `preset` instead.
    empty: bool,
    /// (object, side, bytes queued for that side to read), for a restore.
    preset: Vec<(ObjectKey, usize, Vec<u8>)>,
}

/// The object and side an fd is an end of, when its rule is [`FdAction::Pair`].
pub fn object_of(entry: &FdEntry) -> Option<(ObjectKey, usize)> {
    if entry.action() != FdAction::Pair {
        return None;
    }
    match &entry.kind {
        FdKind::Pipe => {
            let side = usize::from(entry.flags & libc::O_ACCMODE == libc::O_WRONLY);
            Some((ObjectKey::Pipe(entry.ino), side))
        }
        FdKind::Socket(sock) => {
            let peer = sock.peer.unwrap_or(0);
            let other = if peer == 0 { u64::MAX } else { peer };
            let low = sock.ino.min(other);
            Some((ObjectKey::Unix(low), usize::from(sock.ino != low)))
        }
        _ => None,
    }
}

impl CloneObjects {
    /// The objects of the given template processes' fds (host pid, inventory).
    pub fn plan(processes: &[(i32, &[FdEntry])]) -> CloneObjects {
        let mut objects: BTreeMap<ObjectKey, Object> = BTreeMap::new();
        for (pid, entries) in processes {
            for entry in entries.iter() {
                let Some((key, side)) = object_of(entry) else {
                    continue;
                };
                let kind = match &entry.kind {
                    FdKind::Socket(sock) => Kind::Unix {
                        sock_type: sock.sock_type,
                    },
                    _ => Kind::Pipe,
                };
                objects
                    .entry(key)
                    .or_insert_with(|| Object {
                        kind,
                        ends: Vec::new(),
                        made: None,
                        in_creator: None,
                    })
                    .ends
                    .push(TemplateEnd {
                        pid: *pid,
                        fd: entry.fd,
                        side,
                        flags: entry.flags,
                        target: entry.target.clone(),
                    });
            }
        }
        CloneObjects {
            objects,
            empty: false,
            preset: Vec::new(),
        }
    }

    /// The same objects, made without a live template: each gets the bytes
    /// given for it (object, side that reads them, bytes) and nothing else.
    pub fn with_data(
        mut self,
        data: impl IntoIterator<Item = (ObjectKey, usize, Vec<u8>)>,
    ) -> CloneObjects {
        self.empty = true;
        self.preset = data.into_iter().collect();
        self
    }

    /// Whether there is nothing to create.
    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }

    /// Whether the objects were created already (by [`CloneObjects::create`]
    /// in an earlier process of the clone's tree), or there are none.
    pub fn is_created(&self) -> bool {
        self.objects.values().all(|o| o.made.is_some())
    }

    /// The template's fds on each object.
    pub fn ends(&self) -> impl Iterator<Item = (ObjectKey, &[TemplateEnd])> {
        self.objects.iter().map(|(k, o)| (*k, o.ends.as_slice()))
    }

    /// Create every object in `tracee` (a forked process in the clone's
    /// namespaces), take the tracer's duplicates of the new ends, and copy the
    /// data buffered in the template's objects (the template processes must be
    /// stopped).
    pub(crate) fn create(&mut self, tracee: &mut Tracee, scratch: &mut Scratch) -> Result<()> {
        let creator = pidfd_open(tracee.pid())?;
        let mut template_pidfds: BTreeMap<i32, OwnedFd> = BTreeMap::new();
        let kinds: Vec<Kind> = self.objects.values().map(|o| o.kind).collect();
        let pairs = make_all(tracee, scratch, &kinds)?;
        for ((key, object), nums) in self.objects.iter_mut().zip(pairs) {
            object.in_creator = Some(nums);
            let made = [
                pidfd_getfd(&creator, tracee.pid(), nums[0])?,
                pidfd_getfd(&creator, tracee.pid(), nums[1])?,
            ];
            if self.empty {
                for (k, side, data) in &self.preset {
                    if k == key {
                        fill(&made[1 - (*side).min(1)], data).map_err(|source| {
                            RemoteError::Sys {
                                op: "writing a restored pipe's or socket pair's buffered data",
                                pid: tracee.pid(),
                                source,
                            }
                        })?;
                    }
                }
                object.made = Some(made);
                continue;
            }
            let mut template_fd = |side: Option<usize>,
                                   readable: bool|
             -> Result<Option<(i32, i32, String, OwnedFd)>> {
                let end = object.ends.iter().find(|e| {
                    side.is_none_or(|s| e.side == s)
                        && (!readable || e.flags & libc::O_ACCMODE != libc::O_WRONLY)
                });
                let Some(end) = end else { return Ok(None) };
                let pidfd = match template_pidfds.entry(end.pid) {
                    std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::btree_map::Entry::Vacant(e) => e.insert(pidfd_open(end.pid)?),
                };
                let dup = pidfd_getfd(pidfd, end.pid, end.fd)?;
                Ok(Some((end.pid, end.fd, end.target.clone(), dup)))
            };
            match object.kind {
                Kind::Pipe => {
                    if let Some((pid, fd, target, from)) = template_fd(None, true)? {
                        copy_pipe(&from, &made[1]).map_err(|source| RemoteError::Sys {
                            op: "copying a pipe's buffered data (tee)",
                            pid,
                            source: io::Error::new(
                                source.kind(),
                                format!("fd {fd} ({target}): {source}"),
                            ),
                        })?;
                    }
                }
                Kind::Unix { sock_type } => {
                    for side in 0..2 {
                        if let Some((pid, fd, target, from)) = template_fd(Some(side), false)? {
                            copy_queue(&from, sock_type, &made[1 - side]).map_err(|e| match e {
                                CopyError::FdsInFlight => RemoteError::UnsupportedFd {
                                    pid,
                                    fd,
                                    kind: target.clone(),
                                    reason: "data buffered in it carries fds (SCM_RIGHTS), which a clone cannot copy".into(),
                                },
                                CopyError::EmptyDatagram => RemoteError::UnsupportedFd {
                                    pid,
                                    fd,
                                    kind: target.clone(),
                                    reason: "a zero-length datagram is buffered in it; its boundary cannot be copied".into(),
                                },
                                CopyError::Io(op, source) => RemoteError::Sys { op, pid, source },
                            })?;
                        }
                    }
                }
            }
            object.made = Some(made);
        }
        Ok(())
    }

    /// Install the new ends at the fds template process `template_pid` had on
    /// them, in `tracee` (a process forked from it): `dup3` where `tracee`
    /// created the objects, else a hand-over of the tracer's duplicates. Each
    /// end gets the template's `O_NONBLOCK` and close-on-exec flags.
    pub(crate) fn install(
        &self,
        tracee: &mut Tracee,
        scratch: &mut Scratch,
        template_pid: i32,
        creator: bool,
    ) -> Result<()> {
        // The moves and flags of every end in one batch, after the hand-overs
        // (each a resume of its own): a handed fd takes the lowest free
        // number, never one of the ends' numbers, which the fork holds.
        let mut batch = Batch::new();
        for object in self.objects.values() {
            let Some(made) = &object.made else {
                continue;
            };
            // Where it was created, its ends are still open there (until
            // close_in_creator); elsewhere they are handed over.
            let nums = object.in_creator.filter(|_| creator);
            for end in object.ends.iter().filter(|e| e.pid == template_pid) {
                // A pipe end opened for reading and writing (a FIFO opened
                // O_RDWR): a new open of the new pipe, through /proc.
                let rdwr = object.kind == Kind::Pipe && end.flags & libc::O_ACCMODE == libc::O_RDWR;
                let (from, handed) = if rdwr || nums.is_none() {
                    let reopened;
                    let fd = if rdwr {
                        reopened = reopen_rdwr(&made[0]).map_err(|source| RemoteError::Sys {
                            op: "open(/proc/self/fd/N, O_RDWR) of a new pipe",
                            pid: tracee.pid(),
                            source,
                        })?;
                        &reopened
                    } else {
                        &made[end.side]
                    };
                    use std::os::fd::AsFd;
                    let got = install_fds_with(tracee, scratch, &[fd.as_fd()])?;
                    (got[0], true)
                } else {
                    (nums.map_or(-1, |n| n[end.side]), false)
                };
                let cloexec = (end.flags & libc::O_CLOEXEC) as u64;
                let context = format!("for fd {}", end.fd);
                batch.push(
                    "dup3",
                    context.clone(),
                    libc::SYS_dup3,
                    &[from as u64, end.fd as u64, cloexec],
                );
                if handed {
                    batch.push("close", context.clone(), libc::SYS_close, &[from as u64]);
                }
                // New ends are blocking: only a non-blocking one needs a call.
                let status = (end.flags & libc::O_NONBLOCK) as u64;
                if status != 0 {
                    batch.push(
                        "fcntl(F_SETFL)",
                        context,
                        libc::SYS_fcntl,
                        &[end.fd as u64, libc::F_SETFL as u64, status],
                    );
                }
            }
        }
        scratch.reset();
        batch.run(tracee, scratch)?;
        Ok(())
    }

    /// Close the new ends in the process that created them (their numbers there
    /// were free in the template) once every end is installed.
    pub(crate) fn close_in_creator(
        &mut self,
        tracee: &mut Tracee,
        scratch: &mut Scratch,
    ) -> Result<()> {
        let mut batch = Batch::new();
        for object in self.objects.values_mut() {
            if let Some(nums) = object.in_creator.take() {
                for n in nums {
                    batch.push(
                        "close",
                        "new object's temporary fd".into(),
                        libc::SYS_close,
                        &[n as u64],
                    );
                }
            }
        }
        scratch.reset();
        batch.run(tracee, scratch)?;
        Ok(())
    }
}

/// Inject `pipe2` or `socketpair` (close-on-exec) and return the two fds.
pub(crate) fn make_pair(
    tracee: &mut Tracee,
    scratch: &mut Scratch,
    socket_type: Option<i32>,
) -> Result<[i32; 2]> {
    scratch.reset();
    let addr = scratch.reserve(8)?;
    match socket_type {
        None => tracee.syscall(
            "pipe2",
            || "new pipe".into(),
            libc::SYS_pipe2,
            &[addr, libc::O_CLOEXEC as u64],
        )?,
        Some(ty) => tracee.syscall(
            "socketpair",
            || "new Unix socket pair".into(),
            libc::SYS_socketpair,
            &[
                libc::AF_UNIX as u64,
                (ty | libc::SOCK_CLOEXEC) as u64,
                0,
                addr,
            ],
        )?,
    };
    let mut pair = [0u8; 8];
    tracee.read_mem(addr, &mut pair)?;
    Ok([
        i32::from_ne_bytes([pair[0], pair[1], pair[2], pair[3]]),
        i32::from_ne_bytes([pair[4], pair[5], pair[6], pair[7]]),
    ])
}

/// Write `data` into `end` (a new pipe's write end, or the socket that
/// sends to the side that reads it), growing a pipe to hold it all; it must
/// all fit, as nothing reads it yet.
fn fill(end: &OwnedFd, data: &[u8]) -> io::Result<()> {
    let fd = end.as_raw_fd();
    // SAFETY: fcntl with integer arguments on an fd we own.
    let size = unsafe { libc::fcntl(fd, libc::F_GETPIPE_SZ) };
    if size >= 0 && (size as usize) < data.len() {
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd, libc::F_SETPIPE_SZ, data.len() as libc::c_int) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    let mut done = 0;
    while done < data.len() {
        // MSG_DONTWAIT on a socket; a pipe sized above never blocks.
        // SAFETY: sends from a live slice; a pipe fails with ENOTSOCK, then write.
        let mut n = unsafe {
            libc::send(
                fd,
                data[done..].as_ptr().cast(),
                data.len() - done,
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENOTSOCK) {
            // SAFETY: writes from a live slice to an fd we own.
            n = unsafe { libc::write(fd, data[done..].as_ptr().cast(), data.len() - done) };
        }
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        done += n as usize;
    }
    Ok(())
}

/// Make one object of each of `kinds` in `tracee` (close-on-exec), with one
/// batch of `pipe2` and `socketpair` calls; the two fds of each, in order.
fn make_all(tracee: &mut Tracee, scratch: &mut Scratch, kinds: &[Kind]) -> Result<Vec<[i32; 2]>> {
    if kinds.is_empty() {
        return Ok(Vec::new());
    }
    // The pairs' slots first, the batch's program and table after them.
    scratch.reset();
    let slots = scratch.reserve(8 * kinds.len())?;
    let mut batch = Batch::new();
    for (i, kind) in kinds.iter().enumerate() {
        let addr = slots + 8 * i as u64;
        match kind {
            Kind::Pipe => batch.push(
                "pipe2",
                "new pipe".into(),
                libc::SYS_pipe2,
                &[addr, libc::O_CLOEXEC as u64],
            ),
            Kind::Unix { sock_type } => batch.push(
                "socketpair",
                "new Unix socket pair".into(),
                libc::SYS_socketpair,
                &[
                    libc::AF_UNIX as u64,
                    (sock_type | libc::SOCK_CLOEXEC) as u64,
                    0,
                    addr,
                ],
            ),
        }
    }
    batch.run(tracee, scratch)?;
    let mut raw = vec![0u8; 8 * kinds.len()];
    tracee.read_mem(slots, &mut raw)?;
    Ok(raw
        .chunks_exact(8)
        .map(|p| {
            [
                i32::from_ne_bytes([p[0], p[1], p[2], p[3]]),
                i32::from_ne_bytes([p[4], p[5], p[6], p[7]]),
            ]
        })
        .collect())
}

fn reopen_rdwr(end: &OwnedFd) -> io::Result<OwnedFd> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{}", end.as_raw_fd()))?;
    Ok(file.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fdinfo::{mark_peers_inside, SocketInfo};

    fn unix(fd: i32, ino: u64, peer: Option<u64>, sock_type: i32) -> FdEntry {
        FdEntry {
            fd,
            target: format!("socket:[{ino}]"),
            flags: libc::O_RDWR,
            pos: 0,
            ino,
            kind: FdKind::Socket(SocketInfo {
                domain: libc::AF_UNIX,
                sock_type,
                protocol: 0,
                listening: false,
                connected: true,
                local: Vec::new(),
                reuseaddr: false,
                reuseport: false,
                keepalive: false,
                broadcast: false,
                v6only: None,
                nodelay: None,
                backlog: None,
                peer_addr: vec![1, 0],
                ino,
                peer,
                peer_inside: false,
                peer_bound_inside: false,
                fds_in_flight: false,
            }),
            not_box_stdio: false,
        }
    }

    fn pipe(fd: i32, ino: u64, flags: i32) -> FdEntry {
        FdEntry {
            fd,
            target: format!("pipe:[{ino}]"),
            flags,
            pos: 0,
            ino,
            kind: FdKind::Pipe,
            not_box_stdio: false,
        }
    }

    /// Ends in two processes, a dup'd end, a peer outside, a closed peer.
    #[test]
    fn objects_are_keyed_by_the_template_object_across_processes() {
        let mut first = vec![
            unix(3, 100, Some(101), libc::SOCK_STREAM),
            unix(4, 100, Some(101), libc::SOCK_STREAM),
            unix(5, 200, Some(999), libc::SOCK_STREAM),
            unix(6, 300, Some(0), libc::SOCK_DGRAM),
            pipe(7, 50, libc::O_RDONLY),
        ];
        let mut second = vec![
            unix(3, 101, Some(100), libc::SOCK_STREAM),
            pipe(8, 50, libc::O_WRONLY),
        ];
        mark_peers_inside(&mut [&mut first[..], &mut second[..]]);
        let actions: Vec<FdAction> = first.iter().map(FdEntry::action).collect();
        assert_eq!(
            actions,
            [
                FdAction::Pair,
                FdAction::Pair,
                FdAction::Placeholder,
                FdAction::Pair,
                FdAction::Pair
            ]
        );
        assert_eq!(second[0].action(), FdAction::Pair);
        let plan = CloneObjects::plan(&[(10, &first), (11, &second)]);
        type Ends = Vec<(i32, i32, usize)>;
        let objects: Vec<(ObjectKey, Ends)> = plan
            .ends()
            .map(|(k, ends)| (k, ends.iter().map(|e| (e.pid, e.fd, e.side)).collect()))
            .collect();
        assert_eq!(
            objects,
            [
                (ObjectKey::Pipe(50), vec![(10, 7, 0), (11, 8, 1)]),
                (
                    ObjectKey::Unix(100),
                    vec![(10, 3, 0), (10, 4, 0), (11, 3, 1)]
                ),
                (ObjectKey::Unix(300), vec![(10, 6, 0)]),
            ]
        );
        // A client of a datagram server of the box is connected again.
        let mut client = unix(9, 400, Some(500), libc::SOCK_DGRAM);
        if let FdKind::Socket(sock) = &mut client.kind {
            sock.peer_addr = b"\x01\0/run/log".to_vec();
        }
        let mut server = unix(10, 500, None, libc::SOCK_DGRAM);
        if let FdKind::Socket(sock) = &mut server.kind {
            sock.connected = false;
        }
        let mut third = [client, server];
        mark_peers_inside(&mut [&mut third[..]]);
        assert_eq!(third[0].action(), FdAction::Recreate);
        assert_eq!(third[1].action(), FdAction::Recreate);
        // Alone, the first process's connection has its peer outside.
        let mut alone = first.clone();
        mark_peers_inside(&mut [&mut alone[..]]);
        assert_eq!(alone[0].action(), FdAction::Placeholder);
    }
}
