//! `nestbox serve`: a long-lived process answering requests on a Unix socket,
//! for callers that make clones at a rate where starting a `nestbox` process
//! per request would be most of the cost (serverless front ends, test farms).
//!
//! Protocol: the client sends one JSON object per line and reads one JSON
//! object per line back, in order, on one connection as long as it likes.
//!
//! ```text
//! {"op":"ping"}                                     → {"ok":true}
//! {"op":"clone","template":"T","name":"N"?,"on_clone_signal":"USR1"?}
//!     → {"ok":true,"name":"N","pid":1234,"address":"10.…"|null}
//! anything else or a failure                        → {"ok":false,"error":"one line"}
//! ```
//!
//! A clone made here is exactly what `nestbox clone T -d` makes (the same
//! code: claimed from the template's pool when it has one). The socket is
//! created mode 0600 in the root's runtime directory; requests are served one
//! at a time. SIGTERM or SIGINT removes the socket and ends the server.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use serde_json::{json, Value};

use crate::clone::{clone_template_answer_first, CloneRequest, FollowUp};
use crate::registry::Registry;
use crate::{Result, RuntimeError};

/// A client idle this long is dropped, so one stuck client cannot stop the
/// server from serving others.
const CLIENT_IDLE: Duration = Duration::from_secs(10);
/// The bookkeeping that follows clone answers waits until no request has come
/// for this long: a client's first use of its clone, and the next requests of
/// a burst, do not share the CPUs with it.
const FOLLOW_UP_IDLE: Duration = Duration::from_millis(5);
/// ... but no longer than this after the answer.
const FOLLOW_UP_LATEST: Duration = Duration::from_millis(100);

/// Follow-ups of answered requests, done once the server is idle.
#[derive(Debug, Default)]
struct Pending {
    work: FollowUp,
    since: Option<Instant>,
}

impl Pending {
    fn add(&mut self, more: FollowUp) {
        if more.is_empty() {
            return;
        }
        self.work.absorb(more);
        self.since.get_or_insert_with(Instant::now);
    }

    /// How long to wait for the next request before doing the follow-ups
    /// (`None`: nothing pending).
    fn wait(&self) -> Option<Duration> {
        let since = self.since?;
        Some(FOLLOW_UP_IDLE.min(FOLLOW_UP_LATEST.saturating_sub(since.elapsed())))
    }

    fn finish(&mut self, reg: &Registry) {
        self.since = None;
        if let Err(e) = std::mem::take(&mut self.work).finish(reg) {
            eprintln!("nestbox serve: after a clone: {e}");
        }
    }
}

/// The default socket of a root.
pub fn default_socket(reg: &Registry) -> PathBuf {
    reg.roots().run.join("nestbox.sock")
}

/// Serve requests on `socket` until SIGTERM or SIGINT. Refuses to start when
/// another server answers on it; a stale socket file is replaced.
pub fn serve(reg: &Registry, socket: &Path) -> Result<()> {
    if UnixStream::connect(socket).is_ok() {
        return Err(RuntimeError::Invalid(format!(
            "a server already answers on {}",
            socket.display()
        )));
    }
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).map_err(RuntimeError::io("mkdir", dir))?;
    }
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket).map_err(RuntimeError::io("bind", socket))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .map_err(RuntimeError::io("chmod", socket))?;
    let result = serve_on(reg, &listener);
    let _ = std::fs::remove_file(socket);
    result
}

fn serve_on(reg: &Registry, listener: &UnixListener) -> Result<()> {
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGTERM);
    mask.add(Signal::SIGINT);
    mask.thread_block()
        .map_err(RuntimeError::sys("sigprocmask"))?;
    let signals = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(RuntimeError::sys("signalfd"))?;
    // A client that goes away mid-answer must not kill the server.
    // SAFETY: ignoring SIGPIPE installs no handler code; writes then fail with EPIPE.
    unsafe { nix::sys::signal::signal(Signal::SIGPIPE, nix::sys::signal::SigHandler::SigIgn) }
        .map_err(RuntimeError::sys("signal(SIGPIPE)"))?;
    let mut pending = Pending::default();
    loop {
        let mut fds = [
            PollFd::new(listener.as_fd(), PollFlags::POLLIN),
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
        ];
        let timeout = match pending.wait() {
            Some(d) => PollTimeout::try_from(d).unwrap_or(PollTimeout::ZERO),
            None => PollTimeout::NONE,
        };
        match poll(&mut fds, timeout) {
            Ok(0) => {
                pending.finish(reg);
                continue;
            }
            Ok(_) => {}
            Err(_) => continue,
        }
        if fds[1].revents().is_some_and(|r| !r.is_empty()) {
            pending.finish(reg);
            return Ok(());
        }
        if let Ok((stream, _)) = listener.accept() {
            if let Ok(Stop) = serve_client(reg, stream, &signals, &mut pending) {
                pending.finish(reg);
                return Ok(());
            }
        }
    }
}

/// A signal to end the server arrived while serving a client.
struct Stop;

/// Serve one connection until it closes, stays idle for [`CLIENT_IDLE`], or a
/// signal asks the server to end (then `Ok(Stop)`). Follow-ups of its answers
/// go to `pending`, and are done here when the client pauses.
fn serve_client(
    reg: &Registry,
    stream: UnixStream,
    signals: &SignalFd,
    pending: &mut Pending,
) -> std::io::Result<Stop> {
    // Reads wake up every SLICE to look for SIGTERM/SIGINT.
    const SLICE: Duration = Duration::from_millis(100);
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    let mut idle = Duration::ZERO;
    loop {
        let slice = pending
            .wait()
            .unwrap_or(SLICE)
            .max(Duration::from_micros(1));
        reader.get_ref().set_read_timeout(Some(slice))?;
        match reader.read_line(&mut line) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(_) => {
                idle = Duration::ZERO;
                if !line.trim().is_empty() {
                    let (answer, follow_up) = match handle(reg, line.trim()) {
                        Ok((v, f)) => (v, f),
                        Err(e) => (
                            json!({"ok": false, "error": e.to_string().replace('\n', " ")}),
                            FollowUp::default(),
                        ),
                    };
                    // The rest of the bookkeeping follows once the server is
                    // idle (also when the client has gone).
                    pending.add(follow_up);
                    let mut text = answer.to_string();
                    text.push('\n');
                    writer.write_all(text.as_bytes())?;
                }
                line.clear();
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                // A partial line stays in `line` until the rest arrives.
                if let Ok(Some(_)) = signals.read_signal() {
                    return Ok(Stop);
                }
                if pending.wait().is_some_and(|d| d <= slice) {
                    pending.finish(reg);
                }
                idle += slice;
                if idle >= CLIENT_IDLE {
                    return Err(e);
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// Answer one request line; what is left to do once the answer is sent comes
/// with it.
pub fn handle(reg: &Registry, line: &str) -> Result<(Value, FollowUp)> {
    let req: Value = serde_json::from_str(line)
        .map_err(|e| RuntimeError::Invalid(format!("request is not JSON: {e}")))?;
    let field = |k: &str| -> Result<Option<String>> {
        match req.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(RuntimeError::Invalid(format!("{k:?} must be a string"))),
        }
    };
    match field("op")?.as_deref() {
        Some("ping") => Ok((json!({"ok": true}), FollowUp::default())),
        Some("clone") => {
            let template = field("template")?
                .ok_or_else(|| RuntimeError::Invalid("clone needs \"template\"".into()))?;
            let on_clone_signal = field("on_clone_signal")?
                .map(|s| crate::spec::parse_signal(&s))
                .transpose()?;
            let request = CloneRequest {
                names: field("name")?.into_iter().collect(),
                count: 1,
                limits: None,
                on_clone_signal,
                pooled: false,
            };
            let (made, follow_up) = clone_template_answer_first(reg, &template, &request)?;
            let Some(c) = made.first() else {
                follow_up.finish(reg)?;
                return Err(RuntimeError::Invalid("no clone was made".into()));
            };
            let answer = json!({"ok": true, "name": c.name, "pid": c.pid, "address": c.address});
            Ok((answer, follow_up))
        }
        Some(op) => Err(RuntimeError::Invalid(format!("unknown op {op:?}"))),
        None => Err(RuntimeError::Invalid("request needs \"op\"".into())),
    }
}
