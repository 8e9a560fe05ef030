//! The in-box agent's own side: `nestbox e2b-agent`, the command of the
//! `base` template's box (and of a cold box of the host image), run from the
//! server's binary mounted read-only at [`AGENT_PATH`] in the box. It speaks
//! the protocol of [`crate::envd::agent`] on the abstract Unix socket
//! [`crate::envd::agent::SOCKET`]: the accepting thread reads each request
//! and starts its command (a thread per running command then waits for its
//! exit), with one fork and exec of this small process (as the sandbox's
//! user: `setgroups(0)`, `setgid`, `setuid`, then `chdir` and `execvp`), where
//! a Python agent forked a whole interpreter. Nothing here is privileged
//! beyond what the box allows its root: the agent is a process of the box.

use std::io::{IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

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
        // is answered without waiting for a thread to be made; a thread then
        // waits for its exit. A client that does not send its request
        // within the bound (only a process of the box could) is dropped.
        let _ = conn.set_read_timeout(Some(REQUEST_TIMEOUT));
        let Some((conn, child)) = serve(conn) else {
            continue;
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

/// Serve one connection's request: a kill, or a start; the connection and
/// the command started, whose exit is still to be answered.
fn serve(conn: UnixStream) -> Option<(UnixStream, Child)> {
    let (req, fds) = request(&conn).ok()?;
    if let Some(pid) = req.get("kill").and_then(Value::as_i64) {
        let signal = req.get("signal").and_then(Value::as_i64).unwrap_or(0);
        // SAFETY: kill has no memory-safety preconditions.
        let ok = unsafe { libc::kill(pid as i32, signal as i32) } == 0;
        let _ = reply(&conn, &json!({"ok": ok}));
        return None;
    }
    let child = start(&conn, &req, fds).ok()??;
    Some((conn, child))
}

/// Wait for `child` to end and answer its exit on `conn`.
fn finish(conn: &UnixStream, mut child: Child) {
    let Ok(status) = child.wait() else {
        return;
    };
    let code = status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(-1);
    let _ = reply(conn, &json!({"exit": code}));
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

/// Start the command of `req` with `fds` as its stdin, stdout and stderr (or
/// on a new terminal) and answer its pid; the command, if it started.
fn start(conn: &UnixStream, req: &Value, fds: Vec<OwnedFd>) -> std::io::Result<Option<Child>> {
    let Some(mut cmd) = command(req) else {
        reply(
            conn,
            &json!({"error": "a start request needs argv", "code": 126}),
        )?;
        return Ok(None);
    };
    let mut master = None;
    let stdio: Vec<OwnedFd> = if req.get("pty").is_some() {
        let (m, slave) = terminal(req)?;
        master = Some(m);
        vec![slave.try_clone()?, slave.try_clone()?, slave]
    } else {
        fds
    };
    let mut stdio = stdio.into_iter();
    let (Some(i), Some(o), Some(e)) = (stdio.next(), stdio.next(), stdio.next()) else {
        reply(
            conn,
            &json!({"error": "a start request needs three descriptors", "code": 126}),
        )?;
        return Ok(None);
    };
    cmd.stdin(Stdio::from(i))
        .stdout(Stdio::from(o))
        .stderr(Stdio::from(e));
    let spawned = cmd.spawn();
    // The child has its copies; the agent's go with `cmd`.
    drop(cmd);
    let child = match spawned {
        Ok(c) => c,
        Err(e) => {
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            };
            reply(conn, &json!({"error": e.to_string(), "code": code}))?;
            return Ok(None);
        }
    };
    let started = json!({"pid": child.id()});
    match &master {
        None => reply(conn, &started)?,
        Some(m) => {
            let mut line = started.to_string().into_bytes();
            line.push(b'\n');
            let raw = [m.as_raw_fd()];
            let cmsg = [ControlMessage::ScmRights(&raw)];
            let iov = [std::io::IoSlice::new(&line)];
            let sent = sendmsg::<()>(conn.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None)?;
            if sent < line.len() {
                (&*conn).write_all(&line[sent..])?;
            }
        }
    }
    drop(master);
    Ok(Some(child))
}
