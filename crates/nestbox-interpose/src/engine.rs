//! The interposition loop: it takes each call the monitor filter stopped,
//! decodes it ([`Event`]), asks the monitors in stack order (the first one
//! that does not let the call through decides), and answers the kernel.
//!
//! Answers that make the kernel run the call with the caller's own arguments
//! (`continue`) may race with a change of those arguments after they were
//! read; the others do not: an error or a value is final, a redirected open
//! is opened here with the path that was checked and its fd installed in the
//! caller, and an allowed connect is made here, on the caller's own socket,
//! with the address that was checked.

use std::ffi::CString;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use nestbox_sys::seccomp_notify as notify;
use nix::errno::Errno;

use crate::event::Event;
use crate::monitors::{Monitor, Verdict};
use crate::spec::MonitorSpec;
use crate::InterposeError;

/// The monitors of a box, in order.
#[derive(Debug)]
pub struct Stack {
    monitors: Vec<Monitor>,
}

impl Stack {
    /// Make the monitors `specs` (`--monitor` texts) ask for, in order;
    /// `trace` monitors write to `trace_log`.
    pub fn open(specs: &[String], trace_log: &Path) -> Result<Stack, InterposeError> {
        let monitors = specs
            .iter()
            .map(|t| Monitor::open(&MonitorSpec::parse(t)?, t, trace_log))
            .collect::<Result<_, _>>()?;
        Ok(Stack { monitors })
    }

    /// Whether a monitor shows callers' pids in the box.
    fn wants_box_pid(&self) -> bool {
        self.monitors.iter().any(Monitor::shows_box_pid)
    }

    /// The decision for `e`: the first monitor (subscribed to its call) that
    /// does not let it through decides.
    pub fn decide(&mut self, e: &Event) -> Verdict {
        for m in self.monitors.iter_mut().filter(|m| m.wants(e.nr)) {
            let v = m.decide(e);
            if v != Verdict::Continue {
                return v;
            }
        }
        Verdict::Continue
    }
}

/// Answer the calls stopped by the filter whose listener is `listener`, with
/// `stack`, until no process uses the filter any more.
pub fn serve(listener: OwnedFd, stack: Stack) {
    let box_pid = stack.wants_box_pid();
    let shared = Shared {
        stack: Arc::new(Mutex::new(stack)),
        box_pid,
        pass_through: Arc::new(AtomicBool::new(false)),
    };
    serve_shared(listener, &shared);
}

/// A stack shared by the loops of several listeners (`nestbox monitor
/// attach`: one listener per process of the box), and its switch to
/// pass-through (`nestbox monitor detach`).
#[derive(Debug, Clone)]
pub struct Shared {
    stack: Arc<Mutex<Stack>>,
    box_pid: bool,
    pass_through: Arc<AtomicBool>,
}

impl Shared {
    /// `stack`, shared, interposing.
    pub fn new(stack: Stack) -> Shared {
        Shared {
            box_pid: stack.wants_box_pid(),
            stack: Arc::new(Mutex::new(stack)),
            pass_through: Arc::new(AtomicBool::new(false)),
        }
    }

    /// From now on every call is let through unasked and unlogged (the
    /// filter stays: each subscribed call still costs a round trip).
    pub fn pass_through(&self) {
        self.pass_through.store(true, Ordering::SeqCst);
    }

    /// Interpose again, with `stack` (a new attach on the same filter).
    pub fn replace(&self, stack: Stack) {
        let mut s = self.stack.lock().unwrap_or_else(|p| p.into_inner());
        *s = stack;
        self.pass_through.store(false, Ordering::SeqCst);
    }

    /// Whether calls are let through unasked.
    pub fn is_pass_through(&self) -> bool {
        self.pass_through.load(Ordering::SeqCst)
    }
}

/// [`serve`] with a shared stack: answer the calls of `listener` with it
/// (or "continue" to all of them once it is switched to pass-through).
pub fn serve_shared(listener: OwnedFd, shared: &Shared) {
    let listener = std::sync::Arc::new(listener);
    if let Err(e) = notify::sync_wake_up(listener.as_fd()) {
        tracing::debug!("monitors: no synchronous wake-ups ({e}): each call costs more");
    }
    loop {
        // Blocks until a call stops. This thread ends with the process
        // that serves the box (it is not joined).
        let n = match notify::receive(listener.as_fd()) {
            Ok(n) => n,
            // The caller went away (a signal, its death) before we read it.
            Err(Errno::ENOENT) | Err(Errno::EINTR) => continue,
            Err(e) => {
                tracing::warn!("monitors: receiving a call: {e}");
                return;
            }
        };
        if shared.is_pass_through() {
            if let Err(e) = notify::respond_continue(listener.as_fd(), n.id) {
                if e != Errno::ENOENT {
                    tracing::warn!(
                        "monitors: letting call {} of {} through: {e}",
                        n.data.nr,
                        n.pid
                    );
                }
            }
            continue;
        }
        let event = Event::decode(&n, shared.box_pid);
        // What was read from the caller's memory belongs to this call of
        // this process (not to a reused pid).
        let read_memory = event.path.is_some() || event.addr.is_some();
        if read_memory && !notify::id_valid(listener.as_fd(), n.id) {
            continue;
        }
        let verdict = shared
            .stack
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .decide(&event);
        if let Verdict::Connect(_) = verdict {
            // A blocking connect may take minutes (a destination that drops
            // the SYN): made in a thread of its own, so that the box's other
            // calls are answered meanwhile.
            let shared = listener.clone();
            let spawned = std::thread::Builder::new()
                .name("monitor connect".into())
                .spawn(move || answer_and_log(shared.as_fd(), &event, &verdict));
            if let Err(e) = spawned {
                tracing::warn!("monitors: no thread for a connect ({e}); it is refused");
                let _ = notify::respond_error(listener.as_fd(), n.id, libc::EAGAIN);
            }
            continue;
        }
        answer_and_log(listener.as_fd(), &event, &verdict);
    }
}

/// [`answer`], a failure logged (but for a caller gone meanwhile).
fn answer_and_log(listener: BorrowedFd<'_>, event: &Event, verdict: &Verdict) {
    if let Err(e) = answer(listener, event, verdict) {
        if e != Errno::ENOENT {
            tracing::warn!(
                "monitors: answering {} of {} ({verdict:?}): {e}",
                event.syscall,
                event.pid
            );
        }
    }
}

fn answer(listener: BorrowedFd<'_>, e: &Event, verdict: &Verdict) -> nix::Result<()> {
    match verdict {
        Verdict::Continue => notify::respond_continue(listener, e.id),
        Verdict::Errno(n) => notify::respond_error(listener, e.id, *n),
        Verdict::Value(v) => notify::respond_value(listener, e.id, *v),
        Verdict::Open(path) => match open_instead(e, path) {
            Ok((fd, cloexec)) => {
                notify::respond_with_fd(listener, e.id, fd.as_fd(), cloexec).map(|_| ())
            }
            Err(errno) => notify::respond_error(listener, e.id, errno as i32),
        },
        Verdict::Connect(addr) => match connect_for(e, *addr) {
            Ok(()) => notify::respond_value(listener, e.id, 0),
            Err(errno) => notify::respond_error(listener, e.id, errno as i32),
        },
    }
}

/// The flags and mode of open call `e`.
fn open_flags(e: &Event) -> (i32, u32) {
    let a = e.args;
    match e.syscall.as_str() {
        "open" => (a[1] as i32, a[2] as u32),
        "creat" => (libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC, a[1] as u32),
        "openat2" => {
            // struct open_how { u64 flags; u64 mode; u64 resolve; }
            let mut how = [0u8; 16];
            let local = [std::io::IoSliceMut::new(&mut how)];
            let remote = [nix::sys::uio::RemoteIoVec {
                base: a[2] as usize,
                len: 16,
            }];
            let _ = nix::sys::uio::process_vm_readv(
                nix::unistd::Pid::from_raw(e.pid as i32),
                &mut { local },
                &remote,
            );
            let flags = u64::from_ne_bytes(how[..8].try_into().unwrap_or_default());
            let mode = u64::from_ne_bytes(how[8..].try_into().unwrap_or_default());
            (flags as i32, mode as u32)
        }
        _ => (a[2] as i32, a[3] as u32),
    }
}

/// Open `path` in the caller's root with the call's flags.
fn open_instead(e: &Event, path: &Path) -> Result<(OwnedFd, bool), Errno> {
    let (flags, mode) = open_flags(e);
    let root = std::fs::File::open(format!("/proc/{}/root", e.pid))
        .map_err(|err| Errno::from_raw(err.raw_os_error().unwrap_or(libc::EIO)))?;
    let rel = path.strip_prefix("/").unwrap_or(path);
    let rel = CString::new(rel.as_os_str().as_encoded_bytes()).map_err(|_| Errno::EINVAL)?;
    let fd = nestbox_sys::fd::open_in_root(root.as_fd(), &rel, flags & !libc::O_CLOEXEC, mode)?;
    Ok((fd, flags & libc::O_CLOEXEC != 0))
}

/// Connect the caller's socket (argument 0 of `e`) to `addr`.
fn connect_for(e: &Event, addr: std::net::SocketAddr) -> Result<(), Errno> {
    let status =
        std::fs::read_to_string(format!("/proc/{}/status", e.pid)).map_err(|_| Errno::ESRCH)?;
    let tgid: i32 = status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or(Errno::ESRCH)?;
    let pidfd = nestbox_sys::pidfd::pidfd_open(tgid)?;
    let sock = nestbox_sys::pidfd::pidfd_getfd(pidfd.as_fd(), e.args[0] as i32)?;
    let raw = std::os::fd::AsRawFd::as_raw_fd(&sock);
    match addr {
        std::net::SocketAddr::V4(a) => {
            nix::sys::socket::connect(raw, &nix::sys::socket::SockaddrIn::from(a))
        }
        std::net::SocketAddr::V6(a) => {
            nix::sys::socket::connect(raw, &nix::sys::socket::SockaddrIn6::from(a))
        }
    }
}
