//! The in-box agent: what E2B's envd is inside its VMs, a process of the
//! sandbox that starts its commands. The `base` template (and a cold box of
//! the host image) runs it as the box's command, so every clone has it,
//! forked with the template and already in the box's namespaces, cgroup,
//! capability set and seccomp filter: a command then costs one fork and exec
//! in the box, where `nestbox exec` starts a process on the host that joins
//! all of those first. The agent is this server's own binary run as
//! `e2b-agent` in the box ([`crate::envd::agentd`]), listening on an abstract
//! Unix socket, which lives in the box's network namespace: the server
//! connects from a short-lived thread that has joined that namespace. This
//! module is the server's side of the protocol.
//!
//! Protocol, one request per connection: a JSON line, with descriptors as
//! `SCM_RIGHTS` where said.
//! - Start `{"argv","env","cwd","uid","gid","stdin":bool,"meta"}` with the
//!   server's stdout and stderr pipes → `{"pid":N}` (in-box pid) then, when
//!   the command has ended and its output with it, `{"exit":CODE}` (128+N
//!   for signal N), or `{"error","code"}` if it could not start (127: not
//!   found, 126: other). The command's own stdin, stdout and stderr are pipes
//!   of the box to the agent, which relays its output to the server's pipes
//!   and keeps `meta` (its tag and configuration) with it.
//! - With `"pty":{"rows","cols"}` and no descriptors, the agent opens a
//!   terminal of the box's devpts, runs the command on it as its controlling
//!   terminal (`setsid -c`), and sends the master side back with `{"pid":N}`.
//! - Jobs `{"jobs":true}` → `{"jobs":[{"pid","meta"}]}`: the commands started
//!   with pipes whose end is not yet told (in a clone of a box: the copies of
//!   its commands).
//! - Attach `{"attach":PID}` with new stdout and stderr pipes →
//!   `{"ok":true}` then, later, `{"exit":CODE}`: the command's output from
//!   now on (and what its relay held for want of a sink) goes there.
//! - Input `{"input":PID,"data":BASE64}` and `{"close_stdin":PID}` →
//!   `{"ok":true}` or `{"error"}`.
//! - Kill `{"kill":PID,"signal":N}` → `{"ok":bool}`.
//!
//! A box without the agent (another image or template) gets `nestbox exec`.

use std::io::{BufRead, BufReader, IoSlice, Write};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use nix::sched::CloneFlags;
use nix::sys::socket::{
    connect, sendmsg, socket, AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr,
};
use serde_json::{json, Value};

use crate::error::{E2bError, Result};

/// The agent's abstract socket name (without the leading NUL).
pub const SOCKET: &str = "nestbox-e2b-agent";

/// A connection to the agent of the box whose init is `pid`; `None` if the
/// box has none (or this server may not join its network namespace).
pub fn connect_to(pid: i32) -> Result<Option<UnixStream>> {
    let ns_path = format!("/proc/{pid}/ns/net");
    let ns = std::fs::File::open(&ns_path).map_err(E2bError::io("open", &ns_path))?;
    // setns(CLONE_NEWNET) changes the calling thread only: one thread of the
    // server goes into the box's network namespace to make the socket (an
    // abstract name is looked up in the namespace the socket was made in)
    // and back. A thread of its own per call if that one is gone.
    let made = match Connector::get().map(|c| c.connect(ns)) {
        Some(Ok(made)) => made,
        Some(Err(ns)) => connect_in_new_thread(ns)?,
        None => return Err(E2bError::Invalid("no thread to reach the agent".into())),
    };
    let fd = made
        .map_err(|e| E2bError::io("connect to the agent of", format!("/proc/{pid}"))(e.into()))?;
    Ok(fd.map(UnixStream::from))
}

/// What connecting in a box's network namespace gave.
type Made = nix::Result<Option<OwnedFd>>;

/// The thread that makes agent connections in boxes' network namespaces
/// (joining one costs far less than making a thread).
#[derive(Debug)]
struct Connector {
    jobs: std::sync::Mutex<
        std::sync::mpsc::Sender<(std::fs::File, std::sync::mpsc::SyncSender<Made>)>,
    >,
}

impl Connector {
    /// The server's connector, started at first use (`None` if no thread
    /// could be made at all).
    fn get() -> Option<&'static Connector> {
        static CONNECTOR: std::sync::OnceLock<Option<Connector>> = std::sync::OnceLock::new();
        CONNECTOR
            .get_or_init(|| {
                let (tx, rx) = std::sync::mpsc::channel();
                std::thread::Builder::new()
                    .name("e2b-netns".into())
                    .spawn(move || connector_thread(rx))
                    .ok()?;
                Some(Connector {
                    jobs: std::sync::Mutex::new(tx),
                })
            })
            .as_ref()
    }

    /// Connect to the agent in namespace `ns`; `Err(ns)` back if the thread
    /// has ended.
    fn connect(&self, ns: std::fs::File) -> std::result::Result<Made, std::fs::File> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let sent = self
            .jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send((ns, tx));
        match sent {
            // (It answers every job it takes.)
            Ok(()) => Ok(rx.recv().unwrap_or(Err(nix::errno::Errno::ECONNABORTED))),
            Err(std::sync::mpsc::SendError((ns, _))) => Err(ns),
        }
    }
}

/// The connector: for each job, join the box's network namespace, make the
/// socket, come back, connect. If it cannot come back to the server's own
/// namespace it ends (a thread left in a box's namespace must not serve on).
fn connector_thread(
    jobs: std::sync::mpsc::Receiver<(std::fs::File, std::sync::mpsc::SyncSender<Made>)>,
) {
    let Ok(own) = std::fs::File::open("/proc/thread-self/ns/net") else {
        return;
    };
    for (ns, answer) in jobs {
        let made = match nix::sched::setns(&ns, CloneFlags::CLONE_NEWNET) {
            // Without the privilege to join (a server without root), the box
            // is served as one without the agent.
            Err(nix::errno::Errno::EPERM) => Ok(None),
            Err(e) => Err(e),
            Ok(()) => {
                let fd = socket(
                    AddressFamily::Unix,
                    SockType::Stream,
                    SockFlag::SOCK_CLOEXEC,
                    None,
                );
                if let Err(e) = nix::sched::setns(&own, CloneFlags::CLONE_NEWNET) {
                    tracing::error!("e2b: back from a box's network namespace: {e}");
                    let _ = answer.send(Err(e));
                    return;
                }
                fd.and_then(connect_agent)
            }
        };
        let _ = answer.send(made);
    }
}

/// Connect `fd` (made in the box's network namespace) to the agent; `None`
/// if nothing listens there.
fn connect_agent(fd: OwnedFd) -> Made {
    let addr = UnixAddr::new_abstract(SOCKET.as_bytes())?;
    match connect(fd.as_raw_fd(), &addr) {
        Ok(()) => Ok(Some(fd)),
        Err(nix::errno::Errno::ECONNREFUSED) => Ok(None),
        Err(e) => Err(e),
    }
}

/// [`connect_to`]'s work in a short-lived thread of its own.
fn connect_in_new_thread(ns: std::fs::File) -> Result<Made> {
    std::thread::spawn(move || -> Made {
        match nix::sched::setns(&ns, CloneFlags::CLONE_NEWNET) {
            Err(nix::errno::Errno::EPERM) => return Ok(None),
            other => other?,
        }
        let fd = socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        connect_agent(fd)
    })
    .join()
    .map_err(|_| E2bError::Invalid("the agent connection thread panicked".into()))
}

/// Send `request` with `fds` (none for a kill).
fn send(conn: &UnixStream, request: &Value, fds: &[BorrowedFd<'_>]) -> Result<()> {
    let mut line = request.to_string().into_bytes();
    line.push(b'\n');
    let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsg };
    let iov = [IoSlice::new(&line)];
    let sent = sendmsg::<()>(conn.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None)
        .map_err(|e| E2bError::io("send to", "the agent")(e.into()))?;
    if sent < line.len() {
        (&*conn)
            .write_all(&line[sent..])
            .map_err(E2bError::io("send to", "the agent"))?;
    }
    Ok(())
}

/// Read one answer line.
pub fn answer(reader: &mut BufReader<UnixStream>) -> Result<Value> {
    let mut line = String::new();
    reader
        .read_line(&mut line)
        .map_err(E2bError::io("read from", "the agent"))?;
    if line.is_empty() {
        return Err(E2bError::Invalid("the agent closed the connection".into()));
    }
    serde_json::from_str(&line)
        .map_err(|e| E2bError::Invalid(format!("the agent's answer is not JSON: {e}")))
}

/// What starting a command through the agent gave.
#[derive(Debug)]
pub enum Started {
    /// It runs: its pid in the box, and the connection its exit comes on.
    Running(u32, BufReader<UnixStream>),
    /// It could not start: the exit code and why.
    Failed(i32, String),
}

/// What the agent is asked to run: the command line, its environment,
/// directory and ids, whether it gets a stdin pipe, and what the agent keeps
/// with it for [`jobs`] (its tag and configuration).
#[derive(Debug)]
pub struct Launch<'a> {
    /// Program and arguments.
    pub argv: &'a [String],
    /// Environment added to the agent's.
    pub env: &'a [(String, String)],
    /// Working directory.
    pub cwd: &'a str,
    /// User and group ids in the box.
    pub ids: (u32, u32),
    /// A stdin pipe (written through [`input`]), else `/dev/null`.
    pub stdin: bool,
    /// Kept by the agent with the command.
    pub meta: Value,
}

/// Start `launch` through the agent on `conn`, its output going to the
/// pipes `sinks` (stdout, stderr).
pub fn start(conn: UnixStream, launch: &Launch<'_>, sinks: [BorrowedFd<'_>; 2]) -> Result<Started> {
    let env: serde_json::Map<String, Value> = launch
        .env
        .iter()
        .map(|(k, v)| (k.clone(), json!(v)))
        .collect();
    let request = json!({"argv": launch.argv, "env": env, "cwd": launch.cwd,
        "uid": launch.ids.0, "gid": launch.ids.1, "stdin": launch.stdin, "meta": launch.meta});
    send(&conn, &request, &sinks)?;
    let mut reader = BufReader::new(conn);
    let a = answer(&mut reader)?;
    if let Some(pid) = a.get("pid").and_then(Value::as_u64) {
        return Ok(Started::Running(pid as u32, reader));
    }
    let (code, why) = failure(&a);
    Ok(Started::Failed(code, why))
}

/// The commands started with pipes that the agent of the box of init
/// `root_pid` still runs (or whose end it has not yet told): pid and meta.
/// In a clone of a box these are the copies of the box's commands.
/// A box without the agent has none.
pub fn jobs(root_pid: i32) -> Result<Vec<(u32, Value)>> {
    let Some(conn) = connect_to(root_pid)? else {
        return Ok(Vec::new());
    };
    send(&conn, &json!({"jobs": true}), &[])?;
    let a = answer(&mut BufReader::new(conn))?;
    Ok(a.get("jobs")
        .and_then(Value::as_array)
        .map(|list| {
            list.iter()
                .filter_map(|j| {
                    let pid = j.get("pid").and_then(Value::as_u64)?;
                    Some((pid as u32, j.get("meta").cloned().unwrap_or(Value::Null)))
                })
                .collect()
        })
        .unwrap_or_default())
}

/// Attach the pipes `sinks` (stdout, stderr) to command `pid` of the box of
/// init `root_pid`: the connection its exit comes on, or `None` if the agent
/// has no such command.
pub fn attach(
    root_pid: i32,
    pid: u32,
    sinks: [BorrowedFd<'_>; 2],
) -> Result<Option<BufReader<UnixStream>>> {
    let conn = connect_to(root_pid)?.ok_or_else(agent_gone)?;
    send(&conn, &json!({"attach": pid}), &sinks)?;
    let mut reader = BufReader::new(conn);
    let a = answer(&mut reader)?;
    Ok((a.get("ok") == Some(&json!(true))).then_some(reader))
}

/// Write `data` to the stdin of command `pid` of the box of init `root_pid`.
pub fn input(root_pid: i32, pid: u32, data: &[u8]) -> Result<()> {
    let data = crate::util::base64_encode(data);
    refused(ask(root_pid, &json!({"input": pid, "data": data}))?)
}

/// Close the stdin of command `pid` of the box of init `root_pid`.
pub fn close_stdin(root_pid: i32, pid: u32) -> Result<()> {
    refused(ask(root_pid, &json!({"close_stdin": pid}))?)
}

/// An answer `{"error": …}` as an error.
fn refused(a: Value) -> Result<()> {
    match a.get("error").and_then(Value::as_str) {
        Some(why) => Err(E2bError::Invalid(why.to_string())),
        None => Ok(()),
    }
}

/// The agent of a box that has none any more.
fn agent_gone() -> E2bError {
    E2bError::NotFound("the sandbox's agent is gone".into())
}

/// Send `request` to the agent of the box of init `root_pid`; its answer.
fn ask(root_pid: i32, request: &Value) -> Result<Value> {
    let conn = connect_to(root_pid)?.ok_or_else(agent_gone)?;
    send(&conn, request, &[])?;
    answer(&mut BufReader::new(conn))
}

/// The exit code and reason of an answer that is no pid.
fn failure(a: &Value) -> (i32, String) {
    let code = a.get("code").and_then(Value::as_i64).unwrap_or(126) as i32;
    let why = a
        .get("error")
        .and_then(Value::as_str)
        .unwrap_or("the agent started nothing")
        .to_string();
    (code, why)
}

/// What starting a command on a terminal through the agent gave.
#[derive(Debug)]
pub enum PtyStarted {
    /// It runs: its pid in the box, the terminal's master side, and the
    /// connection its exit comes on.
    Running(u32, OwnedFd, BufReader<UnixStream>),
    /// It could not start: the exit code and why.
    Failed(i32, String),
}

/// Start `argv` on a new terminal of the box through the agent on `conn`:
/// its pid, the terminal's master side, and the connection its exit comes on.
pub fn start_pty(
    conn: UnixStream,
    argv: &[String],
    env: &[(String, String)],
    cwd: &str,
    ids: (u32, u32),
    size: (u16, u16),
) -> Result<PtyStarted> {
    let env: serde_json::Map<String, Value> =
        env.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
    let request = json!({"argv": argv, "env": env, "cwd": cwd, "uid": ids.0, "gid": ids.1,
        "pty": {"rows": size.0, "cols": size.1}});
    send(&conn, &request, &[])?;
    // The answer line comes with the master's descriptor (an error without).
    let mut buf = vec![0u8; 4096];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let (n, fd) = {
        let mut iov = [std::io::IoSliceMut::new(&mut buf)];
        let msg = nix::sys::socket::recvmsg::<()>(
            conn.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(|e| E2bError::io("receive from", "the agent")(e.into()))?;
        let mut fd = None;
        if let Ok(cmsgs) = msg.cmsgs() {
            for c in cmsgs {
                if let nix::sys::socket::ControlMessageOwned::ScmRights(fds) = c {
                    for raw in fds {
                        // SAFETY: the kernel installed this descriptor for us
                        // with the message; nothing else owns it.
                        let owned =
                            unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
                        fd.get_or_insert(owned);
                    }
                }
            }
        }
        (msg.bytes, fd)
    };
    let mut reader = BufReader::new(conn);
    let mut line = buf[..n].to_vec();
    if !line.ends_with(b"\n") {
        let mut rest = Vec::new();
        reader
            .read_until(b'\n', &mut rest)
            .map_err(E2bError::io("read from", "the agent"))?;
        line.extend(rest);
    }
    let a: Value = serde_json::from_slice(&line)
        .map_err(|e| E2bError::Invalid(format!("the agent's answer is not JSON: {e}")))?;
    match (a.get("pid").and_then(Value::as_u64), fd) {
        (Some(pid), Some(master)) => Ok(PtyStarted::Running(pid as u32, master, reader)),
        _ => {
            let (code, why) = failure(&a);
            Ok(PtyStarted::Failed(code, why))
        }
    }
}

/// Set the size of the terminal whose master side is `master`.
pub fn resize(master: BorrowedFd<'_>, rows: u16, cols: u16) -> Result<()> {
    let size = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one `winsize` from the pointer, which is valid
    // for the call; the descriptor is borrowed, so open.
    let rc = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &size) };
    if rc < 0 {
        return Err(E2bError::io("resize", "a terminal")(
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Signal in-box process `pid` through the agent of the box of init `root_pid`.
pub fn kill(root_pid: i32, pid: u32, signal: i32) -> Result<bool> {
    Ok(ask(root_pid, &json!({"kill": pid, "signal": signal}))?.get("ok") == Some(&json!(true)))
}

/// A pipe, both ends close-on-exec.
pub fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| E2bError::io("pipe", "for a command")(e.into()))
}

/// `/dev/null` for reading.
pub fn dev_null() -> Result<OwnedFd> {
    let f = std::fs::File::open("/dev/null").map_err(E2bError::io("open", "/dev/null"))?;
    Ok(OwnedFd::from(f))
}
