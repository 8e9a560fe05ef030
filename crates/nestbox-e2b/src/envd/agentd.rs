//! The in-box agent's own side: `nestbox e2b-agent`, the command of the
//! `base` template's box (and of a cold box of the host image), run from the
//! server's binary mounted read-only at [`AGENT_PATH`] in the box. It speaks
//! the protocol of [`crate::envd::agent`] on the abstract Unix socket
//! [`crate::envd::agent::SOCKET`]: the accepting thread reads each request
//! and starts its command with one fork and exec of this small process (as
//! the sandbox's user: `setgroups(0)`, `setgid`, `setuid`, then `chdir` and
//! `execvp`), where a Python agent forked a whole interpreter. A thread per
//! command then relays its output from pipes of the box to the server's
//! pipes and tells its exit ([`relay`]): everything a command needs lives in
//! the box, so a clone of the box has a copy of each command that goes on
//! once the server attaches to it. Nothing here is privileged beyond what
//! the box allows its root: the agent is a process of the box.

use std::collections::HashMap;
use std::fs::File;
use std::io::{IoSliceMut, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{
    bind, listen, recvmsg, sendmsg, socket, AddressFamily, Backlog, ControlMessage,
    ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr,
};
use serde_json::{json, Value};

use crate::envd::agent::SOCKET;

/// Where the agent's binary is mounted in the box, and what it is run as.
pub const AGENT_PATH: &str = "/run/e2b-agent";
/// The hidden subcommand that runs the agent.
pub const SUBCOMMAND: &str = "e2b-agent";
/// How long the agent waits for a connection's request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest request line (a command line with its environment).
const MAX_REQUEST: usize = 1 << 20;
/// How long output may still come once a command has exited (from
/// processes it left behind holding its pipes) before its exit is told.
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(100);

/// Listen on the agent's socket and serve every connection; returns only if
/// the socket cannot be made.
pub fn run() -> std::io::Result<()> {
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let addr = UnixAddr::new_abstract(SOCKET.as_bytes())?;
    bind(fd.as_raw_fd(), &addr)?;
    listen(&fd, Backlog::new(512).unwrap_or(Backlog::MAXCONN))?;
    let listener = UnixListener::from(fd);
    for conn in listener.incoming() {
        let Ok(conn) = conn else {
            // (Out of descriptors, say: not a busy loop meanwhile.)
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        // The request is read and the command started here, so that its pid
        // is answered without waiting for a thread to be made; a thread of
        // the command then relays its output and tells its exit. A client
        // that does not send its request within the bound (only a process of
        // the box could) is dropped.
        let _ = conn.set_read_timeout(Some(REQUEST_TIMEOUT));
        serve(conn);
    }
    Ok(())
}

/// Write one answer line.
fn reply(conn: &UnixStream, answer: &Value) -> std::io::Result<()> {
    let mut line = answer.to_string().into_bytes();
    line.push(b'\n');
    (&*conn).write_all(&line)
}

/// Read the request line and the descriptors sent with it.
fn request(conn: &UnixStream) -> std::io::Result<(Value, Vec<OwnedFd>)> {
    let mut buf = vec![0u8; 64 << 10];
    let mut space = nix::cmsg_space!([RawFd; 3]);
    let (n, fds) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<()>(
            conn.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )?;
        let mut fds = Vec::new();
        for c in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                for fd in raw {
                    // SAFETY: the kernel installed this descriptor in this
                    // process with the message; nothing else owns it.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        (msg.bytes, fds)
    };
    let mut data = buf[..n].to_vec();
    while !data.ends_with(b"\n") {
        if data.len() > MAX_REQUEST {
            return Err(std::io::Error::other("request line too long"));
        }
        let got = (&*conn).read(&mut buf)?;
        if got == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        data.extend_from_slice(&buf[..got]);
    }
    let value = serde_json::from_slice(&data).map_err(std::io::Error::other)?;
    Ok((value, fds))
}

/// Serve one connection's request: a kill, the list of commands, an attach,
/// stdin input or its end, or a start.
fn serve(conn: UnixStream) {
    let Ok((req, fds)) = request(&conn) else {
        return;
    };
    if let Some(pid) = req.get("kill").and_then(Value::as_i64) {
        let signal = req.get("signal").and_then(Value::as_i64).unwrap_or(0);
        // SAFETY: kill has no memory-safety preconditions.
        let ok = unsafe { libc::kill(pid as i32, signal as i32) } == 0;
        let _ = reply(&conn, &json!({"ok": ok}));
    } else if req.get("jobs").is_some() {
        let list: Vec<Value> = jobs()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|j| !j.next.lock().unwrap_or_else(|p| p.into_inner()).told)
            .map(|j| json!({"pid": j.pid, "meta": j.meta}))
            .collect();
        let _ = reply(&conn, &json!({"jobs": list}));
    } else if let Some(pid) = req.get("attach").and_then(Value::as_u64) {
        attach(conn, pid as u32, fds);
    } else if let Some(pid) = req.get("input").and_then(Value::as_u64) {
        // Written by a thread of its own: a command that does not read its
        // stdin must not hold up the agent.
        let data = req
            .get("data")
            .and_then(Value::as_str)
            .and_then(crate::util::base64_decode);
        in_thread("agent-input", move || {
            let answer = match (job(pid as u32), data) {
                (_, None) => json!({"error": "input needs base64 data"}),
                (None, _) => json!({"error": format!("no command {pid}")}),
                (Some(j), Some(data)) => j.write_stdin(&data),
            };
            let _ = reply(&conn, &answer);
        });
    } else if let Some(pid) = req.get("close_stdin").and_then(Value::as_u64) {
        // (Its stdin may be held by an input still being written.)
        in_thread("agent-input", move || {
            let answer = match job(pid as u32) {
                None => json!({"error": format!("no command {pid}")}),
                Some(j) => {
                    j.stdin.lock().unwrap_or_else(|p| p.into_inner()).take();
                    json!({"ok": true})
                }
            };
            let _ = reply(&conn, &answer);
        });
    } else if req.get("pty").is_some() {
        let Ok(Some(child)) = start_pty(&conn, &req) else {
            return;
        };
        let waiter = std::thread::Builder::new()
            .name("agent".into())
            .stack_size(64 << 10)
            .spawn(move || finish(&conn, child));
        if let Err(e) = waiter {
            // The command runs on; the server sees the connection close
            // without its exit.
            tracing::warn!("e2b agent: no thread to wait for a command: {e}");
        }
    } else {
        let _ = start(conn, &req, fds);
    }
}

/// Run `work` in a thread of its own (a small stack: it writes to a pipe
/// and answers); logged if no thread can be made (the request's connection
/// then closes unanswered).
fn in_thread(name: &str, work: impl FnOnce() + Send + 'static) {
    let spawned = std::thread::Builder::new()
        .name(name.into())
        .stack_size(64 << 10)
        .spawn(work);
    if let Err(e) = spawned {
        tracing::warn!("e2b agent: no thread for a request: {e}");
    }
}

/// Wait for `child` (a command on a terminal) to end and answer its exit on
/// `conn`.
fn finish(conn: &UnixStream, mut child: Child) {
    let Ok(status) = child.wait() else {
        return;
    };
    let _ = reply(conn, &json!({"exit": exit_code(status)}));
}

/// The exit code of `status` as a shell gives it (128+N for signal N).
fn exit_code(status: std::process::ExitStatus) -> i32 {
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(-1)
}

/// The command's argv, environment, directory and ids from a start request.
fn command(req: &Value) -> Option<Command> {
    let argv: Vec<&str> = req
        .get("argv")?
        .as_array()?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let (program, args) = argv.split_first()?;
    let mut cmd = if req.get("pty").is_some() {
        // On the terminal as its controlling terminal, in a session of its own.
        let mut c = Command::new("setsid");
        c.arg("-c").arg(program);
        c
    } else {
        Command::new(program)
    };
    cmd.args(args);
    // The agent's environment (the box's), the clone's own host name, then
    // what the request sets.
    if let Ok(name) = nix::unistd::gethostname() {
        cmd.env("HOSTNAME", name);
    }
    if let Some(env) = req.get("env").and_then(Value::as_object) {
        for (k, v) in env {
            if let Some(v) = v.as_str() {
                cmd.env(k, v);
            }
        }
    }
    if let Some(cwd) = req.get("cwd").and_then(Value::as_str) {
        cmd.current_dir(cwd);
    }
    // std drops the supplementary groups (setgroups(0)) when it sets the uid
    // as root.
    cmd.uid(req.get("uid").and_then(Value::as_u64).unwrap_or(0) as u32);
    cmd.gid(req.get("gid").and_then(Value::as_u64).unwrap_or(0) as u32);
    Some(cmd)
}

/// A terminal: its master side, and its slave side with the given size.
fn terminal(req: &Value) -> std::io::Result<(nix::pty::PtyMaster, OwnedFd)> {
    let flags =
        nix::fcntl::OFlag::O_RDWR | nix::fcntl::OFlag::O_NOCTTY | nix::fcntl::OFlag::O_CLOEXEC;
    let master = nix::pty::posix_openpt(flags)?;
    nix::pty::grantpt(&master)?;
    nix::pty::unlockpt(&master)?;
    let path = nix::pty::ptsname_r(&master)?;
    let slave: OwnedFd = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY)
        .open(&path)?
        .into();
    let dim = |k: &str| {
        req.pointer(&format!("/pty/{k}"))
            .and_then(Value::as_u64)
            .unwrap_or(24) as u16
    };
    let size = libc::winsize {
        ws_row: dim("rows"),
        ws_col: dim("cols"),
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one `winsize` from the pointer, valid for the
    // call; the descriptor is open (owned here).
    if unsafe { libc::ioctl(slave.as_raw_fd(), libc::TIOCSWINSZ, &size) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((master, slave))
}

/// Start the command of `req` on a new terminal of the box, and answer its
/// pid with the terminal's master side; the command, if it started. A
/// command on a terminal is not followed into clones of the box (the
/// terminal is a device of the box, which a clone would share).
fn start_pty(conn: &UnixStream, req: &Value) -> std::io::Result<Option<Child>> {
    let Some(mut cmd) = command(req) else {
        reply(
            conn,
            &json!({"error": "a start request needs argv", "code": 126}),
        )?;
        return Ok(None);
    };
    let (master, slave) = terminal(req)?;
    cmd.stdin(Stdio::from(slave.try_clone()?))
        .stdout(Stdio::from(slave.try_clone()?))
        .stderr(Stdio::from(slave));
    let spawned = cmd.spawn();
    // The child has its copies; the agent's go with `cmd`.
    drop(cmd);
    let child = match spawned {
        Ok(c) => c,
        Err(e) => {
            reply(conn, &spawn_failure(&e))?;
            return Ok(None);
        }
    };
    let mut line = json!({"pid": child.id()}).to_string().into_bytes();
    line.push(b'\n');
    let raw = [master.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let iov = [std::io::IoSlice::new(&line)];
    let sent = sendmsg::<()>(conn.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None)?;
    if sent < line.len() {
        (&*conn).write_all(&line[sent..])?;
    }
    Ok(Some(child))
}

/// The answer to a command that could not be started (127: not found).
fn spawn_failure(e: &std::io::Error) -> Value {
    let code = if e.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    };
    json!({"error": e.to_string(), "code": code})
}

/// A pipe of the box, both ends close-on-exec: (read, write).
fn pipe() -> std::io::Result<(File, File)> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    Ok((File::from(r), File::from(w)))
}

/// Where a command's output and exit go: the server's two pipes and the
/// connection its exit is answered on.
struct Sinks {
    out: File,
    err: File,
    control: UnixStream,
}

/// A command started with pipes. Its stdin, stdout and stderr are pipes of
/// the box between it and the agent, which relays its output to the sinks of
/// whoever is attached and writes what it is sent to its stdin. A clone of
/// the box has a copy of all of it (pipes of the box, with the bytes in
/// them, are cloned; the server's ends are not), so the server attaches to
/// the clone's copy and the command goes on there with nothing lost.
struct Job {
    pid: u32,
    /// What the server keeps with the command (its tag, its configuration),
    /// answered by `jobs`.
    meta: Value,
    /// The write end of its stdin; `None` without one, or once closed.
    stdin: Mutex<Option<File>>,
    /// Sinks of an attach, for the relay to take when woken, and whether
    /// its end was told (then no attach is taken: one lock, so that an
    /// attach either comes before the end is told or is refused).
    next: Mutex<Attach>,
    /// Wakes the relay (a pipe of the box: a clone has its own).
    wake: File,
}

impl Job {
    /// Write `data` to the command's stdin; the answer.
    fn write_stdin(&self, data: &[u8]) -> Value {
        let mut stdin = self.stdin.lock().unwrap_or_else(|p| p.into_inner());
        match stdin.as_mut() {
            None => json!({"error": format!("command {} has no stdin open", self.pid)}),
            Some(w) => match w.write_all(data) {
                Ok(()) => json!({"ok": true}),
                Err(e) => json!({"error": format!("write to the stdin of {}: {e}", self.pid)}),
            },
        }
    }
}

/// What an attach hands the relay of a [`Job`].
#[derive(Default)]
struct Attach {
    sinks: Option<Sinks>,
    told: bool,
}

/// The commands started with pipes that have not yet been seen to the end.
fn jobs() -> &'static Mutex<HashMap<u32, Arc<Job>>> {
    static JOBS: OnceLock<Mutex<HashMap<u32, Arc<Job>>>> = OnceLock::new();
    JOBS.get_or_init(Default::default)
}

/// Command `pid`, if it is one of [`jobs`].
fn job(pid: u32) -> Option<Arc<Job>> {
    jobs()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&pid)
        .cloned()
}

/// Attach the server's pipes `fds` (stdout, stderr) and `conn` to command
/// `pid`: what it writes from now (and what was held for want of a sink)
/// goes there, and its exit is answered on `conn` after `{"ok":true}`.
fn attach(conn: UnixStream, pid: u32, fds: Vec<OwnedFd>) {
    let Some(j) = job(pid) else {
        let _ = reply(&conn, &json!({"error": format!("no command {pid}")}));
        return;
    };
    let mut fds = fds.into_iter();
    let (Some(out), Some(err)) = (fds.next(), fds.next()) else {
        let _ = reply(
            &conn,
            &json!({"error": "an attach needs two descriptors (stdout, stderr)"}),
        );
        return;
    };
    let mut next = j.next.lock().unwrap_or_else(|p| p.into_inner());
    if next.told {
        let _ = reply(&conn, &json!({"error": format!("command {pid} has ended")}));
        return;
    }
    if reply(&conn, &json!({"ok": true})).is_err() {
        return;
    }
    next.sinks = Some(Sinks {
        out: File::from(out),
        err: File::from(err),
        control: conn,
    });
    drop(next);
    let _ = (&j.wake).write_all(b"a");
}

/// Start the command of `req` with pipes of the box, whose output goes to
/// the server's pipes `fds` (stdout, stderr); answer its pid, and relay its
/// output and exit from a thread of its own.
fn start(conn: UnixStream, req: &Value, fds: Vec<OwnedFd>) -> std::io::Result<()> {
    let Some(mut cmd) = command(req) else {
        return reply(
            &conn,
            &json!({"error": "a start request needs argv", "code": 126}),
        );
    };
    let mut fds = fds.into_iter();
    let (Some(out_sink), Some(err_sink)) = (fds.next(), fds.next()) else {
        return reply(
            &conn,
            &json!({"error": "a start request needs two descriptors (stdout, stderr)", "code": 126}),
        );
    };
    let (out_r, out_w) = pipe()?;
    let (err_r, err_w) = pipe()?;
    let (wake_r, wake_w) = pipe()?;
    let stdin = if req.get("stdin") == Some(&Value::Bool(true)) {
        let (r, w) = pipe()?;
        cmd.stdin(Stdio::from(r));
        Some(w)
    } else {
        cmd.stdin(Stdio::null());
        None
    };
    cmd.stdout(Stdio::from(out_w)).stderr(Stdio::from(err_w));
    let spawned = cmd.spawn();
    // The child has its copies; the agent's go with `cmd`.
    drop(cmd);
    let child = match spawned {
        Ok(c) => c,
        Err(e) => return reply(&conn, &spawn_failure(&e)),
    };
    let pid = child.id();
    let pidfd = match nestbox_runtime::process::pidfd_open(pid as i32) {
        Ok(fd) => File::from(fd),
        Err(e) => {
            // (Only if out of descriptors.) Not left running unwatched.
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
            return reply(&conn, &json!({"error": e.to_string(), "code": 126}));
        }
    };
    reply(&conn, &json!({"pid": pid}))?;
    let job = Arc::new(Job {
        pid,
        meta: req.get("meta").cloned().unwrap_or(Value::Null),
        stdin: Mutex::new(stdin),
        next: Mutex::new(Attach::default()),
        wake: wake_w,
    });
    jobs()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(pid, job.clone());
    let sinks = Sinks {
        out: File::from(out_sink),
        err: File::from(err_sink),
        control: conn,
    };
    let relay_job = job.clone();
    let spawned = std::thread::Builder::new()
        .name("agent".into())
        .stack_size(64 << 10)
        .spawn(move || relay(&relay_job, [out_r, err_r], pidfd, wake_r, sinks));
    if let Err(e) = spawned {
        // Its output could go nowhere: ended (the server sees the connection
        // close without its exit).
        tracing::warn!("e2b agent: no thread to relay command {pid}: {e}");
        jobs()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&pid);
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        let _ = child_exit(pid);
    }
    Ok(())
}

/// Reap command `pid`; its exit code.
fn child_exit(pid: u32) -> i32 {
    use nix::sys::wait::{waitpid, WaitStatus};
    loop {
        match waitpid(nix::unistd::Pid::from_raw(pid as i32), None) {
            Ok(WaitStatus::Exited(_, code)) => return code,
            Ok(WaitStatus::Signaled(_, sig, _)) => return 128 + sig as i32,
            Ok(_) | Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return -1,
        }
    }
}

/// Relay command `job`'s output (`sources`: its stdout and stderr pipes) to
/// the sinks attached, and answer its exit (seen on `pidfd`) once its
/// output has ended (or [`DRAIN_AFTER_EXIT`] after the exit, for output of
/// processes it left behind). A sink that fails (its server gone: the copy
/// of the connection in a clone of the box) is dropped and what could not
/// be written is kept; nothing is read meanwhile, so the command's pipes
/// fill as they would with a slow reader, until an attach (`wake`) brings
/// new sinks.
fn relay(job: &Job, sources: [File; 2], pidfd: File, mut wake: File, first: Sinks) {
    let mut sinks = Some(first);
    let [out, err] = sources;
    let mut sources = [Some(out), Some(err)];
    let mut pending: [Vec<u8>; 2] = [Vec::new(), Vec::new()];
    let mut exit: Option<i32> = None;
    let mut drain_until = Instant::now();
    let mut buf = vec![0u8; 64 << 10];
    // Closed once the command is reaped: a pidfd of an ended process is one
    // a clone of the box cannot copy, so holding it on (through the drain,
    // past the exit told) would make a fork right after the command fail.
    let mut pidfd = Some(pidfd);
    loop {
        if let Some(new) = job
            .next
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .sinks
            .take()
        {
            sinks = Some(new);
            if exit.is_some() {
                drain_until = Instant::now() + DRAIN_AFTER_EXIT;
            }
        }
        if let Some(s) = sinks.as_mut() {
            let delivered = write_pending(&mut s.out, &mut pending[0])
                .and_then(|()| write_pending(&mut s.err, &mut pending[1]));
            if delivered.is_err() {
                sinks = None;
            }
        }
        if let (Some(code), true) = (exit, sources.iter().all(Option::is_none)) {
            if let Some(Sinks { out, err, control }) = sinks.take() {
                // The output ends before the exit is told.
                drop((out, err));
                let mut next = job.next.lock().unwrap_or_else(|p| p.into_inner());
                if next.sinks.is_none() && reply(&control, &json!({"exit": code})).is_ok() {
                    next.told = true;
                    break;
                }
                drop(next);
                // Not told: kept for the next attach.
                continue;
            }
        }
        let attached = sinks.is_some();
        let mut fds = vec![PollFd::new(wake.as_fd(), PollFlags::POLLIN)];
        if attached {
            fds.extend(
                sources
                    .iter()
                    .flatten()
                    .map(|s| PollFd::new(s.as_fd(), PollFlags::POLLIN)),
            );
        }
        if let (None, Some(p)) = (exit, &pidfd) {
            fds.push(PollFd::new(p.as_fd(), PollFlags::POLLIN));
        }
        let timeout = if attached && exit.is_some() {
            let left = drain_until.saturating_duration_since(Instant::now());
            PollTimeout::from(left.as_millis().min(u16::MAX as u128) as u16)
        } else {
            PollTimeout::NONE
        };
        let polled = poll(&mut fds, timeout);
        let ready: Vec<bool> = fds
            .iter()
            .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        drop(fds);
        if polled == Ok(0) && attached && exit.is_some() {
            // The drain is over: what it left behind no longer counts.
            sources = [None, None];
            continue;
        }
        let mut ready = ready.into_iter();
        if ready.next() == Some(true) {
            let _ = wake.read(&mut buf);
        }
        if attached {
            for (i, source) in sources.iter_mut().enumerate() {
                let Some(src) = source else {
                    continue;
                };
                if ready.next() != Some(true) {
                    continue;
                }
                match src.read(&mut buf) {
                    Ok(0) => *source = None,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => *source = None,
                    Ok(n) => pending[i].extend_from_slice(&buf[..n]),
                }
            }
        }
        if exit.is_none() && ready.next() == Some(true) {
            exit = Some(child_exit(job.pid));
            pidfd = None;
            drain_until = Instant::now() + DRAIN_AFTER_EXIT;
        }
    }
    jobs()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&job.pid);
}

/// Write `pending` whole to `sink`, and empty it.
fn write_pending(sink: &mut File, pending: &mut Vec<u8>) -> std::io::Result<()> {
    if !pending.is_empty() {
        sink.write_all(pending)?;
        pending.clear();
    }
    Ok(())
}
