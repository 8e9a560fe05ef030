//! envd's process service (`/process.Process/…`): Start and Connect stream a
//! process's events (start with its pid, stdout/stderr data, end with its
//! exit code); List, SendSignal, SendInput and CloseStdin act on the
//! processes started. Each process is started in the sandbox's box (its
//! namespaces, cgroup, seccomp filter and limits), as the sandbox's user in
//! its home: by the box's in-box agent when it has one ([`agent`]; the pid
//! the SDK sees is the command's in the box), else as `nestbox exec` of the
//! command (the pid is that of the `nestbox exec` process on the host, which
//! the server maps to the command itself when it signals it). A command's
//! output comes to this server through pipes, read by a thread per process
//! (its pump). A pause freezes the commands with the box. A fork or a
//! snapshot clones them with it: the agent relays each command's output
//! through pipes of the box, so in every clone of the box the command goes
//! on, and [`Table::follow`] attaches new pipes to the clone's copy (the
//! sandbox that goes on in a clone keeps its streams, a fork gets its own).
//! Commands on a terminal or run by `nestbox exec` are ended before a fork or
//! snapshot instead ([`Table::end_unfollowed`]).

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use serde_json::{json, Value};

use crate::envd::{agent, connect};
use crate::error::{E2bError, Result};
use crate::http::{Request, Response};
use crate::util::{base64_decode, base64_encode};
use crate::Server;

/// How long output may still come once the command has exited (from
/// processes it left behind holding its pipes) before the end is reported.
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(100);
/// How long a SIGKILL through SendSignal waits for the process to be gone.
const KILL_WAIT: Duration = Duration::from_secs(2);
/// Keep-alive events of an idle stream, unless the client asks otherwise.
const KEEPALIVE: Duration = Duration::from_secs(50);

/// One event of a process.
#[derive(Debug, Clone)]
enum Event {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Pty(Vec<u8>),
    End(i32),
    /// The sandbox was removed: its streams are cut, as the connection to a
    /// VM that is gone is (the SDK then finds the sandbox gone).
    Gone,
}

/// Who listens to a process, and whether it has ended.
#[derive(Debug, Default)]
struct Listeners {
    senders: Vec<Sender<Event>>,
    ended: bool,
}

/// A process started through envd.
#[derive(Debug)]
pub struct Proc {
    pid: u32,
    kind: Kind,
    /// The init of the box whose agent runs it (a sandbox that goes on in a
    /// clone of its box has its commands there; [`Table::follow`]).
    root_pid: AtomicI32,
    tag: Option<String>,
    config: Value,
    /// Its stdin pipe (`nestbox exec`) or terminal; through the agent,
    /// `None`, and [`Proc::stdin_open`] says whether it has one.
    stdin: Mutex<Option<File>>,
    /// Through the agent: whether its stdin is a pipe not yet closed.
    stdin_open: AtomicBool,
    /// The master side of its terminal, if it has one (for resizes).
    pty: Option<File>,
    listeners: Mutex<Listeners>,
    /// Which pump relays its output: one that sees a later generation stops
    /// (its pipes drained) and the next takes over, after a clone.
    generation: AtomicU64,
    /// The thread of the pump now relaying its output.
    pump: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// How a process was started, which says how to signal it and whether it
/// can follow its sandbox into a clone of its box.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `nestbox exec` on the host: `pid` is that process's.
    Exec,
    /// By the box's agent, with pipes: `pid` is the command's in the box.
    Agent,
    /// By the box's agent, on a terminal of the box.
    Pty,
}

impl Proc {
    fn root_pid(&self) -> i32 {
        self.root_pid.load(Ordering::Acquire)
    }

    fn subscribe(&self) -> Option<Receiver<Event>> {
        let mut l = self.listeners.lock().unwrap_or_else(|p| p.into_inner());
        if l.ended {
            return None;
        }
        let (tx, rx) = channel();
        l.senders.push(tx);
        Some(rx)
    }

    /// Wait until the process has ended (its end published), at most `limit`.
    fn wait_ended(&self, limit: Duration) {
        let Some(rx) = self.subscribe() else {
            return;
        };
        let end = Instant::now() + limit;
        while let Ok(event) = rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
            if matches!(event, Event::End(_) | Event::Gone) {
                return;
            }
        }
    }

    fn publish(&self, event: Event) {
        let mut l = self.listeners.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(event, Event::End(_) | Event::Gone) {
            l.ended = true;
        }
        l.senders.retain(|s| s.send(event.clone()).is_ok());
    }

    /// Send `signal` to the command (found below the `nestbox exec`
    /// process: exec → its helper in the box → the command).
    fn signal(&self, signal: i32) -> Result<()> {
        if self.kind != Kind::Exec {
            agent::kill(self.root_pid(), self.pid, signal)?;
            return Ok(());
        }
        let end = Instant::now() + Duration::from_secs(2);
        loop {
            let helper = children(self.pid).into_iter().next();
            if let Some(command) = helper.and_then(|h| children(h).into_iter().next()) {
                // SAFETY: kill has no memory-safety preconditions.
                let rc = unsafe { libc::kill(command as i32, signal) };
                return if rc == 0
                    || std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
                {
                    Ok(())
                } else {
                    Err(E2bError::io("kill", format!("/proc/{command}"))(
                        std::io::Error::last_os_error(),
                    ))
                };
            }
            if !std::path::Path::new(&format!("/proc/{}", self.pid)).exists() {
                // Ended meanwhile.
                return Ok(());
            }
            if Instant::now() >= end {
                return Err(E2bError::NotFound(format!(
                    "process {} has no command to signal",
                    self.pid
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// The children of process `pid`.
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// The processes of one sandbox.
#[derive(Debug, Default)]
pub struct Table {
    procs: Mutex<HashMap<u32, Arc<Proc>>>,
}

impl Table {
    fn insert(&self, p: Arc<Proc>) {
        self.lock().insert(p.pid, p);
    }

    fn remove(&self, pid: u32) {
        self.lock().remove(&pid);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<Proc>>> {
        self.procs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The process a `ProcessSelector` (`{"pid":N}` or `{"tag":"T"}`) names.
    fn select(&self, selector: &Value) -> Result<Arc<Proc>> {
        let procs = self.lock();
        let found = if let Some(pid) = selector.get("pid").and_then(Value::as_u64) {
            procs.get(&(pid as u32)).cloned()
        } else if let Some(tag) = selector.get("tag").and_then(Value::as_str) {
            procs
                .values()
                .find(|p| p.tag.as_deref() == Some(tag))
                .cloned()
        } else {
            return Err(E2bError::Invalid(
                "process selector needs pid or tag".into(),
            ));
        };
        found.ok_or_else(|| E2bError::NotFound(format!("process {selector} not found")))
    }

    /// Cut the streams of every process, then kill them (the sandbox is
    /// removed).
    pub fn remove_all(&self) {
        for p in self.lock().values() {
            p.publish(Event::Gone);
        }
        self.kill_all();
    }

    /// Kill every process that cannot follow its sandbox into a clone of
    /// its box (one on a terminal, which is a device of the box a clone
    /// would share; one run by `nestbox exec`, whose pipes end on this
    /// server), and wait, at most `limit` in all, until each has been
    /// reaped and its end reported: their streams see them end. Commands
    /// the agent started with pipes stay ([`Table::follow`]).
    pub fn end_unfollowed(&self, limit: Duration) {
        let procs: Vec<Arc<Proc>> = self
            .lock()
            .values()
            .filter(|p| p.kind != Kind::Agent)
            .cloned()
            .collect();
        for p in &procs {
            p.kill();
        }
        let end = Instant::now() + limit;
        for p in procs {
            p.wait_ended(end.saturating_duration_since(Instant::now()));
        }
    }

    /// Kill every process (their streams see them end).
    pub fn kill_all(&self) {
        let procs: Vec<Arc<Proc>> = self.lock().values().cloned().collect();
        for p in procs {
            p.kill();
        }
    }

    /// Take up the commands that the agent of the box of init `root_pid`
    /// runs with pipes: the copies, in a clone of a box, of the commands
    /// started there. A command this table has (the sandbox went on in a
    /// clone of its box) keeps its listeners, and its output now comes from
    /// the clone, after what its old pipes still held; any other (a fork, a
    /// sandbox made from a snapshot) is added, as its meta describes it. A
    /// command the agent no longer has ended before the clone was made.
    /// With `retake_known` false, a command this table has is left as it is
    /// (the box is the one it runs in: only commands this server does not
    /// know, those of a server before it, are taken up).
    pub fn follow(self: &Arc<Self>, root_pid: i32, retake_known: bool) -> Result<()> {
        for (pid, meta) in agent::jobs(root_pid)? {
            if !retake_known && self.lock().contains_key(&pid) {
                continue;
            }
            let (out_r, out_w) = agent::pipe()?;
            let (err_r, err_w) = agent::pipe()?;
            let Some(exit) = agent::attach(root_pid, pid, [out_w.as_fd(), err_w.as_fd()])? else {
                continue;
            };
            drop((out_w, err_w));
            let runner = Runner::Agent {
                out: File::from(out_r),
                err: File::from(err_r),
                exit,
            };
            let known = self.lock().get(&pid).cloned();
            let p = match known {
                Some(p) => {
                    p.root_pid.store(root_pid, Ordering::Release);
                    p
                }
                None => {
                    let p = Arc::new(Proc::of_agent(pid, root_pid, &meta));
                    self.insert(p.clone());
                    p
                }
            };
            pump_in_thread(self, &p, runner)?;
        }
        Ok(())
    }
}

impl Proc {
    /// A command the agent runs with pipes, as its `meta` describes it.
    fn of_agent(pid: u32, root_pid: i32, meta: &Value) -> Proc {
        Proc {
            pid,
            kind: Kind::Agent,
            root_pid: AtomicI32::new(root_pid),
            tag: meta.get("tag").and_then(Value::as_str).map(String::from),
            config: meta.get("config").cloned().unwrap_or(Value::Null),
            stdin: Mutex::new(None),
            stdin_open: AtomicBool::new(meta.get("stdin") == Some(&Value::Bool(true))),
            pty: None,
            listeners: Mutex::new(Listeners::default()),
            generation: AtomicU64::new(0),
            pump: Mutex::new(None),
        }
    }

    /// SIGKILL it (through the agent, which may be gone with its box: then
    /// its commands went with it).
    fn kill(&self) {
        match self.kind {
            // SAFETY: kill has no memory-safety preconditions.
            Kind::Exec => unsafe {
                libc::kill(self.pid as i32, libc::SIGKILL);
            },
            Kind::Agent | Kind::Pty => {
                let _ = agent::kill(self.root_pid(), self.pid, libc::SIGKILL);
            }
        }
    }
}

/// Relay `p`'s output and exit from `runner` in a thread of its own. A pump
/// already relaying it is stopped first, once it has drained its pipes (so
/// nothing of the old output is lost or comes after the new).
fn pump_in_thread(table: &Arc<Table>, p: &Arc<Proc>, runner: Runner) -> Result<()> {
    let generation = p.generation.fetch_add(1, Ordering::AcqRel) + 1;
    let old = p.pump.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(old) = old {
        let _ = old.join();
    }
    let (pumped, table) = (p.clone(), table.clone());
    let handle = std::thread::Builder::new()
        .name("e2b-proc".into())
        .spawn(move || {
            if let Some(code) = pump(&pumped, runner, generation) {
                table.remove(pumped.pid);
                pumped.publish(Event::End(code));
            }
        })
        .map_err(E2bError::io("spawn a thread for", "a process"))?;
    *p.pump.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
    Ok(())
}

/// Answer `/process.Process/METHOD`.
pub fn handle(server: &Arc<Server>, id: &str, method: &str, req: &Request) -> Response {
    let streaming = matches!(method, "Start" | "Connect");
    let fail = |e: E2bError| {
        if streaming {
            connect::stream_error(e)
        } else {
            connect::unary(Err(e))
        }
    };
    let sandbox = match server.sandbox(id) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let msg = match connect::message(req) {
        Ok(m) => m,
        Err(e) => return fail(e),
    };
    let deadline = req
        .header("connect-timeout-ms")
        .and_then(|t| t.parse::<u64>().ok())
        .map(|ms| Instant::now() + Duration::from_millis(ms));
    let keepalive = req
        .header("keepalive-ping-interval")
        .and_then(|t| t.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(KEEPALIVE);
    match method {
        "Start" => {
            let user = crate::sandbox::user_of_authorization(req.header("authorization"));
            match start(server, &sandbox, &msg, user.as_deref()) {
                Ok((proc_, rx)) => stream(proc_, rx, deadline, keepalive),
                Err(e) => fail(e),
            }
        }
        "Connect" => {
            let found = msg
                .get("process")
                .ok_or_else(|| E2bError::Invalid("Connect needs process".into()))
                .and_then(|sel| sandbox.procs.select(sel));
            match found {
                Ok(p) => match p.subscribe() {
                    Some(rx) => stream(p, rx, deadline, keepalive),
                    None => fail(E2bError::NotFound(format!("process {} has ended", p.pid))),
                },
                Err(e) => fail(e),
            }
        }
        "List" => connect::unary(Ok(json!({
            "processes": sandbox
                .procs
                .lock()
                .values()
                .map(|p| {
                    let mut info = json!({"pid": p.pid, "config": p.config});
                    if let Some(t) = &p.tag {
                        info["tag"] = json!(t);
                    }
                    info
                })
                .collect::<Vec<_>>()
        }))),
        "SendSignal" => connect::unary((|| {
            let p = sandbox
                .procs
                .select(msg.get("process").unwrap_or(&Value::Null))?;
            let signal = match msg.get("signal") {
                Some(Value::String(s)) if s == "SIGNAL_SIGTERM" => libc::SIGTERM,
                Some(Value::String(s)) if s == "SIGNAL_SIGKILL" => libc::SIGKILL,
                Some(Value::Number(n)) if n.as_i64() == Some(15) => libc::SIGTERM,
                Some(Value::Number(n)) if n.as_i64() == Some(9) => libc::SIGKILL,
                other => {
                    return Err(E2bError::Invalid(format!("unsupported signal {other:?}")));
                }
            };
            p.signal(signal)?;
            if signal == libc::SIGKILL {
                // Answered once the process is gone (reaped, its end
                // reported), so that what the caller does next no longer
                // sees it (`kill -0 PID` fails), within a bound.
                p.wait_ended(KILL_WAIT);
            }
            Ok(json!({}))
        })()),
        "SendInput" => connect::unary((|| {
            let p = sandbox
                .procs
                .select(msg.get("process").unwrap_or(&Value::Null))?;
            let data = msg
                .pointer("/input/stdin")
                .or_else(|| msg.pointer("/input/pty"))
                .and_then(Value::as_str)
                .and_then(base64_decode)
                .ok_or_else(|| E2bError::Invalid("SendInput needs input.stdin (base64)".into()))?;
            if p.kind == Kind::Agent {
                if !p.stdin_open.load(Ordering::Acquire) {
                    return Err(E2bError::Invalid(format!(
                        "process {} has no stdin open",
                        p.pid
                    )));
                }
                return agent::input(p.root_pid(), p.pid, &data).map(|()| json!({}));
            }
            let mut stdin = p.stdin.lock().unwrap_or_else(|e| e.into_inner());
            let pipe = stdin
                .as_mut()
                .ok_or_else(|| E2bError::Invalid(format!("process {} has no stdin open", p.pid)))?;
            pipe.write_all(&data)
                .and_then(|()| pipe.flush())
                .map_err(E2bError::io("write stdin of", format!("process {}", p.pid)))?;
            Ok(json!({}))
        })()),
        "Update" => connect::unary((|| {
            let p = sandbox
                .procs
                .select(msg.get("process").unwrap_or(&Value::Null))?;
            let master = p
                .pty
                .as_ref()
                .ok_or_else(|| E2bError::Invalid(format!("process {} has no terminal", p.pid)))?;
            let dim = |k: &str| {
                msg.pointer(&format!("/pty/size/{k}"))
                    .and_then(Value::as_u64)
                    .ok_or_else(|| E2bError::Invalid(format!("Update needs pty.size.{k}")))
            };
            agent::resize(master.as_fd(), dim("rows")? as u16, dim("cols")? as u16)?;
            Ok(json!({}))
        })()),
        "CloseStdin" => connect::unary((|| {
            let p = sandbox
                .procs
                .select(msg.get("process").unwrap_or(&Value::Null))?;
            if p.kind == Kind::Agent {
                if p.stdin_open.swap(false, Ordering::AcqRel) {
                    agent::close_stdin(p.root_pid(), p.pid)?;
                }
                return Ok(json!({}));
            }
            p.stdin.lock().unwrap_or_else(|e| e.into_inner()).take();
            Ok(json!({}))
        })()),
        other => fail(E2bError::Unsupported(format!("process.Process/{other}"))),
    }
}

/// Start the process a `StartRequest` describes; it is registered and its
/// first listener subscribed before it can produce anything.
fn start(
    server: &Arc<Server>,
    sandbox: &Arc<crate::sandbox::Sandbox>,
    msg: &Value,
    user: Option<&str>,
) -> Result<(Arc<Proc>, Receiver<Event>)> {
    let pty_size = msg.get("pty").filter(|p| !p.is_null()).map(|p| {
        let dim = |k: &str| {
            p.pointer(&format!("/size/{k}"))
                .and_then(Value::as_u64)
                .unwrap_or(24)
        };
        (dim("rows") as u16, dim("cols").max(1) as u16)
    });
    let config = msg
        .get("process")
        .cloned()
        .ok_or_else(|| E2bError::Invalid("Start needs process".into()))?;
    let cmd = config
        .get("cmd")
        .and_then(Value::as_str)
        .filter(|c| !c.is_empty())
        .ok_or_else(|| E2bError::Invalid("process.cmd is empty".into()))?;
    let args: Vec<String> = config
        .get("args")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    let started_at = Instant::now();
    let box_name = sandbox.running_box()?;
    let user = sandbox.user(&server.reg, user)?;
    let cwd = user.resolve(config.get("cwd").and_then(Value::as_str).unwrap_or(""));
    let mut env: Vec<(String, String)> = vec![
        ("HOME".into(), user.home.clone()),
        ("USER".into(), user.name.clone()),
        ("LOGNAME".into(), user.name.clone()),
        ("E2B_SANDBOX".into(), "true".into()),
        ("E2B_SANDBOX_ID".into(), sandbox.id.clone()),
    ];
    env.extend(sandbox.env.iter().cloned());
    if let Some(envs) = config.get("envs").and_then(Value::as_object) {
        env.extend(
            envs.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string()))),
        );
    }
    let with_stdin = msg.get("stdin").and_then(Value::as_bool).unwrap_or(false);
    let tag = msg.get("tag").and_then(Value::as_str).map(String::from);
    let mut command = vec![cmd.to_string()];
    command.extend(args);
    // Through the box's agent when it has one, else `nestbox exec`.
    let root_pid = sandbox.root_pid(&server.reg)?;
    let looked_up = started_at.elapsed();
    let conn = agent::connect_to(root_pid)?;
    let connected = started_at.elapsed();
    let (proc_, runner) = match conn {
        Some(conn) if pty_size.is_some() => {
            let size = pty_size.unwrap_or((24, 80));
            match agent::start_pty(conn, &command, &env, &cwd, (user.uid, user.gid), size)? {
                agent::PtyStarted::Running(pid, master, exit) => {
                    let dup = |f: &OwnedFd| {
                        f.try_clone()
                            .map(File::from)
                            .map_err(E2bError::io("dup", "a terminal"))
                    };
                    (
                        Proc {
                            pid,
                            kind: Kind::Pty,
                            root_pid: AtomicI32::new(root_pid),
                            tag,
                            config,
                            stdin: Mutex::new(Some(dup(&master)?)),
                            stdin_open: AtomicBool::new(true),
                            pty: Some(dup(&master)?),
                            listeners: Mutex::new(Listeners::default()),
                            generation: AtomicU64::new(0),
                            pump: Mutex::new(None),
                        },
                        Runner::Pty {
                            master: File::from(master),
                            exit,
                        },
                    )
                }
                agent::PtyStarted::Failed(_, why) => {
                    return Err(E2bError::Invalid(format!("cannot start {cmd:?}: {why}")));
                }
            }
        }
        None if pty_size.is_some() => {
            return Err(E2bError::Unsupported(
                "a PTY in a sandbox without the agent (a template other than base)".into(),
            ));
        }
        Some(conn) => {
            let (out_r, out_w) = agent::pipe()?;
            let (err_r, err_w) = agent::pipe()?;
            let meta = json!({"tag": tag, "config": config, "stdin": with_stdin});
            let launch = agent::Launch {
                argv: &command,
                env: &env,
                cwd: &cwd,
                ids: (user.uid, user.gid),
                stdin: with_stdin,
                meta,
            };
            let started = agent::start(conn, &launch, [out_w.as_fd(), err_w.as_fd()])?;
            drop((out_w, err_w));
            match started {
                agent::Started::Running(pid, reader) => (
                    Proc::of_agent(pid, root_pid, &launch.meta),
                    Runner::Agent {
                        out: File::from(out_r),
                        err: File::from(err_r),
                        exit: reader,
                    },
                ),
                agent::Started::Failed(_, why) => {
                    return Err(E2bError::Invalid(format!("cannot start {cmd:?}: {why}")));
                }
            }
        }
        None => {
            let ids = format!("{}:{}", user.uid, user.gid);
            let mut argv: Vec<String> = vec!["exec".into(), "-u".into(), ids, "-w".into(), cwd];
            for (k, v) in &env {
                argv.push("-e".into());
                argv.push(format!("{k}={v}"));
            }
            argv.push(box_name);
            argv.push("--".into());
            argv.extend(command);
            let argv_ref: Vec<&str> = argv.iter().map(String::as_str).collect();
            let mut child = server
                .nestbox
                .command(&argv_ref)
                .stdin(if with_stdin {
                    Stdio::piped()
                } else {
                    Stdio::null()
                })
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(E2bError::io("run", &server.nestbox.exe))?;
            let stdin = child.stdin.take().map(|s| File::from(OwnedFd::from(s)));
            (
                Proc {
                    pid: child.id(),
                    kind: Kind::Exec,
                    root_pid: AtomicI32::new(root_pid),
                    tag,
                    config,
                    stdin: Mutex::new(stdin),
                    stdin_open: AtomicBool::new(with_stdin),
                    pty: None,
                    listeners: Mutex::new(Listeners::default()),
                    generation: AtomicU64::new(0),
                    pump: Mutex::new(None),
                },
                Runner::Exec(child),
            )
        }
    };
    if phases_wanted() {
        eprintln!(
            "PHASES e2b start: looked up {looked_up:?}, connected {connected:?}, started {:?}",
            started_at.elapsed()
        );
    }
    let proc_ = Arc::new(proc_);
    let rx = proc_
        .subscribe()
        .ok_or_else(|| E2bError::NotFound("process ended".into()))?;
    sandbox.procs.insert(proc_.clone());
    pump_in_thread(&sandbox.procs, &proc_, runner)?;
    Ok((proc_, rx))
}

/// Whether the phases of each command are printed on stderr (the server's
/// log): `NB_PHASES` set in the server's environment, as for clones.
fn phases_wanted() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED.get_or_init(|| std::env::var_os("NB_PHASES").is_some())
}

/// What a process's output and exit come from.
enum Runner {
    /// `nestbox exec`, a child of this server.
    Exec(Child),
    /// The agent: the output pipes, and the connection the exit comes on.
    Agent {
        out: File,
        err: File,
        exit: BufReader<UnixStream>,
    },
    /// The agent, on a terminal: its master side, and the connection.
    Pty {
        master: File,
        exit: BufReader<UnixStream>,
    },
}

/// Relay the process's output to the listeners until it has exited; its
/// exit code. `None` if a pump of a later generation takes over first: the
/// output already in the pipes is relayed, then this one stops.
fn pump(p: &Proc, runner: Runner, generation: u64) -> Option<i32> {
    let mut pty = false;
    let (mut out, mut err, mut child, mut exit) = match runner {
        Runner::Exec(mut c) => {
            let o = c.stdout.take().map(|x| File::from(OwnedFd::from(x)));
            let e = c.stderr.take().map(|x| File::from(OwnedFd::from(x)));
            (o, e, Some(c), None)
        }
        Runner::Agent { out, err, exit } => (Some(out), Some(err), None, Some(exit)),
        Runner::Pty { master, exit } => {
            pty = true;
            (Some(master), None, None, Some(exit))
        }
    };
    let mut exited: Option<(i32, Instant)> = None;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let retired = p.generation.load(Ordering::Acquire) != generation;
        if out.is_none() && err.is_none() && (exited.is_some() || exit.is_none()) {
            break;
        }
        let (out_ready, err_ready, exit_ready) = {
            let mut fds = Vec::new();
            if let Some(o) = &out {
                fds.push(PollFd::new(o.as_fd(), PollFlags::POLLIN));
            }
            if let Some(e) = &err {
                fds.push(PollFd::new(e.as_fd(), PollFlags::POLLIN));
            }
            let watch_exit = !retired && exited.is_none() && exit.is_some();
            if let (true, Some(x)) = (watch_exit, &exit) {
                fds.push(PollFd::new(x.get_ref().as_fd(), PollFlags::POLLIN));
            }
            let wait = if retired { 0u16 } else { 20 };
            let _ = poll(&mut fds, PollTimeout::from(wait));
            let ready = |f: &PollFd<'_>| f.revents().is_some_and(|r| !r.is_empty());
            let mut it = fds.iter();
            let o = out.is_some() && it.next().is_some_and(ready);
            let e = err.is_some() && it.next().is_some_and(ready);
            let x = watch_exit && it.next().is_some_and(ready);
            (o, e, x)
        };
        if out_ready {
            if let Some(o) = out.as_mut() {
                match o.read(&mut buf) {
                    Ok(0) | Err(_) => out = None,
                    Ok(n) if pty => p.publish(Event::Pty(buf[..n].to_vec())),
                    Ok(n) => p.publish(Event::Stdout(buf[..n].to_vec())),
                }
            }
        }
        if err_ready {
            if let Some(e) = err.as_mut() {
                match e.read(&mut buf) {
                    Ok(0) | Err(_) => err = None,
                    Ok(n) => p.publish(Event::Stderr(buf[..n].to_vec())),
                }
            }
        }
        if exited.is_none() {
            if let Some(c) = child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    exited = Some((exit_code(status), Instant::now()));
                }
            }
            if let (true, Some(x)) = (exit_ready, exit.as_mut()) {
                // The agent's last line; none if it went away.
                let code = agent::answer(x)
                    .ok()
                    .and_then(|a| a.get("exit").and_then(Value::as_i64))
                    .unwrap_or(-1);
                exited = Some((code as i32, Instant::now()));
            }
        }
        if retired && !out_ready && !err_ready {
            // Drained (the box these pipes came from is frozen for good).
            return None;
        }
        if let Some((_, at)) = exited {
            if at.elapsed() >= DRAIN_AFTER_EXIT && !out_ready && !err_ready {
                break;
            }
        }
    }
    if exited.is_none() {
        if let Some(x) = exit.as_mut() {
            let code = agent::answer(x)
                .ok()
                .and_then(|a| a.get("exit").and_then(Value::as_i64))
                .unwrap_or(-1);
            exited = Some((code as i32, Instant::now()));
        }
    }
    Some(match (exited, child) {
        (Some((code, _)), _) => code,
        (None, Some(mut c)) => c.wait().map(exit_code).unwrap_or(-1),
        (None, None) => -1,
    })
}

fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(-1)
}

/// The response streaming a process's events from `rx`, opened by the start
/// event; the process is killed when `deadline` passes.
fn stream(
    p: Arc<Proc>,
    rx: Receiver<Event>,
    deadline: Option<Instant>,
    keepalive: Duration,
) -> Response {
    Response::stream(
        200,
        "application/connect+json",
        Box::new(move |w| {
            let streamed_at = Instant::now();
            connect::send(w, &json!({"event": {"start": {"pid": p.pid}}}))?;
            loop {
                let wait = match deadline {
                    Some(d) => keepalive.min(d.saturating_duration_since(Instant::now())),
                    None => keepalive,
                };
                match rx.recv_timeout(wait) {
                    Ok(Event::Stdout(d)) => connect::send(
                        w,
                        &json!({"event": {"data": {"stdout": base64_encode(&d)}}}),
                    )?,
                    Ok(Event::Stderr(d)) => connect::send(
                        w,
                        &json!({"event": {"data": {"stderr": base64_encode(&d)}}}),
                    )?,
                    Ok(Event::Pty(d)) => {
                        connect::send(w, &json!({"event": {"data": {"pty": base64_encode(&d)}}}))?
                    }
                    Ok(Event::End(code)) => {
                        let mut end = json!({"exitCode": code, "exited": true,
                            "status": format!("exit status {code}")});
                        if code > 128 {
                            end["status"] = json!(format!("signal: {}", code - 128));
                        }
                        connect::send_last(w, &json!({"event": {"end": end}}));
                        if phases_wanted() {
                            eprintln!(
                                "PHASES e2b stream: end sent {:?} after the start event",
                                streamed_at.elapsed()
                            );
                        }
                        return connect::end(w, None);
                    }
                    Err(RecvTimeoutError::Timeout) => {
                        if deadline.is_some_and(|d| Instant::now() >= d) {
                            let _ = p.signal(libc::SIGKILL);
                            return connect::end(
                                w,
                                Some(&E2bError::Deadline(format!(
                                    "process {} ran past its timeout and was killed",
                                    p.pid
                                ))),
                            );
                        }
                        connect::send(w, &json!({"event": {"keepalive": {}}}))?;
                    }
                    Ok(Event::Gone) => {
                        return Err(std::io::Error::other(format!(
                            "the sandbox of process {} was removed",
                            p.pid
                        )))
                    }
                    Err(RecvTimeoutError::Disconnected) => return connect::end(w, None),
                }
            }
        }),
    )
}
