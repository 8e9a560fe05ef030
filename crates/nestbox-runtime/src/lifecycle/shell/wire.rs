//! The messages of a shell claim, on `SOCK_SEQPACKET` Unix sockets (one
//! message is one JSON document; descriptors travel with it as `SCM_RIGHTS`):
//! between the claiming `nestbox run` and the shell's monitor, and between the
//! monitor and the shell's init.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{
    recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::spec::BoxSpec;

/// Largest message: a spec with a seccomp profile's text and a long environment.
const MAX_MESSAGE: usize = 1 << 20;

/// Which of the caller's standard descriptors travel with a claim, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stdio {
    /// The command's stdin (`-i`).
    Stdin,
    /// Where the box's output is relayed besides its log (foreground).
    Stdout,
    /// Where the box's error output is relayed besides its log (foreground).
    Stderr,
}

/// From `nestbox run` (or `pool drain`) to a shell's monitor.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ToMonitor {
    /// Become box `spec.name` and run `spec.command`.
    Claim {
        /// The box asked for (its shape must be the shell's).
        spec: Box<BoxSpec>,
        /// The caller leaves once the command runs (`run -d`); otherwise it
        /// waits for the exit and the box ends if it goes away.
        detach: bool,
        /// The descriptors sent with the message, in order.
        stdio: Vec<Stdio>,
        /// Send back the monitor's phase marks (`NESTBOX_PHASES`).
        #[serde(default)]
        phases: bool,
        /// What a cold box's command would inherit from the caller.
        #[serde(default)]
        inherited: Inherited,
    },
    /// Leave the pool: tear the shell down (refused once claimed).
    Drain,
    /// Pass signal `signo` on to the box (a foreground caller got it).
    Signal {
        /// The signal number.
        signo: i32,
    },
}

/// From a shell's monitor to the caller.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum FromMonitor {
    /// The shell is the caller's box now (a foreground claim: the next
    /// message is `Exited`, or `Failed` if the command could not start).
    Taken,
    /// The command runs (its `execve` succeeded; a detached claim).
    Started {
        /// Host pid of the box's init.
        init_pid: i32,
        /// The monitor's phase marks, when asked for: (phase, pid, ns).
        #[serde(default)]
        marks: Vec<(String, i32, u64)>,
    },
    /// Not this shell (claimed by another, draining, broken): try another,
    /// or start the box the ordinary way.
    Refused,
    /// The box could not start; nothing of it is left. `name_in_use`: the
    /// name is taken (the shell stays in the pool).
    Failed {
        /// Exit code for the caller (125, 126, 127).
        code: i32,
        /// The error, one line.
        message: String,
        /// The error is "a box named … already exists".
        #[serde(default)]
        name_in_use: bool,
    },
    /// The box ended (foreground claims).
    Exited {
        /// The command's exit code.
        code: i32,
        /// Killed by the OOM killer at its memory limit.
        oom_killed: bool,
        /// The monitor's phase marks since `Started`, when asked for.
        #[serde(default)]
        marks: Vec<(String, i32, u64)>,
    },
    /// The shell was drained.
    Drained,
}

/// What a cold box's first process (and so its command) inherits from the
/// `nestbox run` that forks it, and a shell's init must therefore take from
/// the claiming `run` instead of the process that made the shell: the file
/// mode mask, the resource limits, the nice value, the CPU affinity and the
/// OOM score adjustment.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Inherited {
    /// `umask`.
    pub umask: u32,
    /// The nice value.
    pub nice: i32,
    /// (resource, soft, hard) of every `RLIMIT_*`.
    pub rlimits: Vec<(u32, u64, u64)>,
    /// The CPUs the process may run on.
    pub cpus: Vec<usize>,
    /// `/proc/self/oom_score_adj`.
    pub oom_score_adj: Option<i32>,
}

impl Inherited {
    /// Those of the calling process.
    pub fn of_this_process() -> Self {
        // SAFETY: umask only swaps this process's mask; it is set back at once
        // (the caller is single-threaded: nothing creates a file meanwhile).
        let umask = unsafe {
            let m = libc::umask(0o022);
            libc::umask(m);
            m
        };
        // SAFETY: getpriority of this process; -1 is a valid nice value,
        // errors (none for PRIO_PROCESS of itself) read as 0.
        let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        let mut rlimits = Vec::new();
        // RLIMIT_CPU (0) to RLIMIT_RTTIME (15): every limit Linux has.
        for resource in 0..16u32 {
            let mut l = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit writes the rlimit it is given.
            if unsafe { libc::getrlimit(resource as _, &mut l) } == 0 {
                rlimits.push((resource, l.rlim_cur, l.rlim_max));
            }
        }
        let cpus = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0))
            .map(|set| {
                (0..nix::sched::CpuSet::count())
                    .filter(|&c| set.is_set(c).unwrap_or(false))
                    .collect()
            })
            .unwrap_or_default();
        let oom_score_adj = std::fs::read_to_string("/proc/self/oom_score_adj")
            .ok()
            .and_then(|s| s.trim().parse().ok());
        Inherited {
            umask,
            nice,
            rlimits,
            cpus,
            oom_score_adj,
        }
    }

    /// Make them the calling process's (best effort, as inheriting them is:
    /// a CPU set the box's cpuset excludes is refused by the kernel and the
    /// process keeps the box's).
    pub fn apply(&self) {
        // SAFETY: umask, setpriority and setrlimit change this process only;
        // the rlimit is a valid struct read by the call.
        unsafe {
            libc::umask(self.umask);
            libc::setpriority(libc::PRIO_PROCESS, 0, self.nice);
            for &(resource, cur, max) in &self.rlimits {
                let l = libc::rlimit {
                    rlim_cur: cur,
                    rlim_max: max,
                };
                libc::setrlimit(resource as _, &l);
            }
        }
        if !self.cpus.is_empty() {
            let mut set = nix::sched::CpuSet::new();
            for &c in &self.cpus {
                let _ = set.set(c);
            }
            let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
        }
        if let Some(adj) = self.oom_score_adj {
            let _ = std::fs::write("/proc/self/oom_score_adj", adj.to_string());
        }
    }
}

/// From a shell's monitor to its init: start the command.
#[derive(Debug, Serialize, Deserialize)]
pub struct Go {
    /// The box's spec (command, environment, user, hostname, …).
    pub spec: Box<BoxSpec>,
    /// The box's setns cookie (its seccomp filter's door).
    pub cookie: Option<[u64; 2]>,
    /// Whether a stdin descriptor follows the report pipe.
    pub stdin: bool,
    /// Whether a pipe for phase marks follows (see [`crate::phases`]).
    #[serde(default)]
    pub phases: bool,
    /// Whether a pipe follows that the command reads one byte from before
    /// its `execve` (see `CommandPlan::hold`).
    #[serde(default)]
    pub hold: bool,
    /// What the command inherits from the caller.
    #[serde(default)]
    pub inherited: Inherited,
}

/// A connected pair of seqpacket sockets (close-on-exec).
pub fn pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    nix::sys::socket::socketpair(
        nix::sys::socket::AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(std::io::Error::from)
}

/// Send `msg` with descriptors `fds` as one message.
pub fn send<T: Serialize>(sock: BorrowedFd<'_>, msg: &T, fds: &[RawFd]) -> std::io::Result<()> {
    let data = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    let iov = [std::io::IoSlice::new(&data)];
    let cmsg = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &cmsg };
    loop {
        match sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(_) => return Ok(()),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Receive one message and its descriptors; `None` at end of file (the peer
/// closed, or a pending connection was reset).
pub fn recv<T: DeserializeOwned>(
    sock: BorrowedFd<'_>,
) -> std::io::Result<Option<(T, Vec<OwnedFd>)>> {
    // The message's size first (waiting for it), so that the buffer is no
    // larger: a large zeroed buffer costs its page faults on every claim.
    let size = loop {
        match nix::sys::socket::recv(
            sock.as_raw_fd(),
            &mut [],
            MsgFlags::MSG_PEEK | MsgFlags::MSG_TRUNC,
        ) {
            Ok(n) => break n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(nix::errno::Errno::ECONNRESET) => return Ok(None),
            Err(e) => return Err(e.into()),
        }
    };
    if size > MAX_MESSAGE {
        return Err(std::io::Error::other(format!("a message of {size} bytes")));
    }
    let mut buf = vec![0u8; size.max(1)];
    let mut space = nix::cmsg_space!([RawFd; 4]);
    let (n, fds) = loop {
        let mut iov = [std::io::IoSliceMut::new(&mut buf)];
        match recvmsg::<()>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(msg) => {
                let mut fds = Vec::new();
                for c in msg.cmsgs()? {
                    if let ControlMessageOwned::ScmRights(raw) = c {
                        for fd in raw {
                            // SAFETY: the kernel installed this descriptor in
                            // this process with the message; nothing else owns it.
                            fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                        }
                    }
                }
                break (msg.bytes, fds);
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(nix::errno::Errno::ECONNRESET) => return Ok(None),
            Err(e) => return Err(e.into()),
        }
    };
    if n == 0 {
        return Ok(None);
    }
    let msg = serde_json::from_slice(&buf[..n]).map_err(std::io::Error::other)?;
    Ok(Some((msg, fds)))
}
