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
//! anything else or a failure
//!     → {"ok":false,"error":"one line","kind":"invalid|not_found|conflict|resources|system|launch","box":"N"?}
//! ```
//!
//! A clone made here is exactly what `nestbox clone T -d` makes (the same
//! code: claimed from the template's pool when it has one). The socket is
//! created mode 0600 in the root's runtime directory. One thread serves every
//! connection (up to [`MAX_CLIENTS`] at once), each request in turn, so a
//! front end may keep its connection open while others connect. What a claim
//! leaves to do after its answer (the clone's name in the hosts file, the
//! pool's refill) is done once no request has come for [`FOLLOW_UP_IDLE`].
//! SIGTERM or SIGINT removes the socket and ends the server.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
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
use crate::prepared_claim::PreparedClaim;
use crate::registry::Registry;
use crate::{Result, RuntimeError};

/// Connections served at once; one more is closed at once.
pub const MAX_CLIENTS: usize = 128;
/// The longest request line; a client that sends more without a newline gets
/// an error and is dropped.
const MAX_LINE: usize = 64 << 10;
/// The bookkeeping that follows clone answers waits until no request has come
/// for this long: a client's first use of its clone, and the next requests of
/// a burst, do not share the CPUs with it.
pub const FOLLOW_UP_IDLE: Duration = Duration::from_millis(5);
/// ... but no longer than this after the answer.
const FOLLOW_UP_LATEST: Duration = Duration::from_millis(100);

/// What the server does between requests: the follow-ups of answered
/// claims, and claims prepared for the next requests (see
/// [`crate::prepared_claim`]) of the templates it has been asked for.
#[derive(Debug, Default)]
struct IdleWork {
    work: FollowUp,
    since: Option<Instant>,
    prepared: HashMap<String, PreparedClaim>,
    /// Templates asked for, most recent last (at most [`PREPARED_TEMPLATES`]).
    wanted: Vec<String>,
    /// When to try again to prepare a claim that found an empty pool.
    retry_at: Option<Instant>,
}

/// Templates for which a claim is kept prepared.
const PREPARED_TEMPLATES: usize = 16;
/// A claim that found its template's pool empty is prepared again this much
/// later (once), when the refill has had time to run.
const PREPARE_RETRY: Duration = Duration::from_millis(250);

impl IdleWork {
    fn add(&mut self, more: FollowUp) {
        if more.is_empty() {
            return;
        }
        self.work.absorb(more);
        self.since.get_or_insert_with(Instant::now);
    }

    /// Keep a claim prepared for `template` from now on.
    fn want(&mut self, template: &str) {
        self.wanted.retain(|t| t != template);
        self.wanted.push(template.to_string());
        if self.wanted.len() > PREPARED_TEMPLATES {
            let gone = self.wanted.remove(0);
            self.prepared.remove(&gone);
        }
    }

    /// How long to wait for the next request before doing the follow-ups
    /// (`None`: nothing to do).
    fn wait(&self) -> Option<Duration> {
        let follow_ups = self
            .since
            .map(|since| FOLLOW_UP_IDLE.min(FOLLOW_UP_LATEST.saturating_sub(since.elapsed())));
        let retry = self
            .retry_at
            .map(|at| at.saturating_duration_since(Instant::now()));
        match (follow_ups, retry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether they have waited as long as they may.
    fn overdue(&self) -> bool {
        self.since.is_some_and(|t| t.elapsed() >= FOLLOW_UP_LATEST)
    }

    /// Do the follow-ups, then prepare a claim for each template wanted that
    /// has none.
    fn finish(&mut self, reg: &Registry) {
        let retrying = self.retry_at.take().is_some();
        if self.since.take().is_some() {
            if let Err(e) = std::mem::take(&mut self.work).finish(reg) {
                tracing::error!("after a clone: {e}");
            }
        }
        let mut empty_pool = false;
        for template in &self.wanted {
            if self.prepared.contains_key(template) {
                continue;
            }
            match crate::prepared_claim::prepare(reg, template) {
                Ok(Some(p)) => {
                    self.prepared.insert(template.clone(), p);
                }
                Ok(None) => empty_pool = true,
                // A template gone or not frozen: its requests will say so.
                Err(_) => {}
            }
        }
        if empty_pool && !retrying {
            self.retry_at = Some(Instant::now() + PREPARE_RETRY);
        }
    }
}

/// Where `nestbox serve` writes its warnings and errors (see [`crate::diag`]).
pub fn log_path(reg: &Registry) -> PathBuf {
    reg.roots().run.join("serve.log")
}

/// The default socket of a root.
pub fn default_socket(reg: &Registry) -> PathBuf {
    reg.roots().run.join("nestbox.sock")
}

/// Serve requests on `socket` until SIGTERM or SIGINT. Refuses to start when
/// another server answers on it; a stale socket file is replaced.
pub fn serve(reg: &Registry, socket: &Path) -> Result<()> {
    if UnixStream::connect(socket).is_ok() {
        return Err(RuntimeError::ServerRunning(socket.to_path_buf()));
    }
    let run = &reg.roots().run;
    std::fs::create_dir_all(run).map_err(RuntimeError::io("mkdir", run))?;
    crate::diag::to_file(log_path(reg), true);
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).map_err(RuntimeError::io("mkdir", dir))?;
    }
    // A stale socket (no server answered above); ENOENT if there is none.
    // Anything else makes the bind fail, which reports it.
    let _ = std::fs::remove_file(socket);
    // The socket is born mode 0600: a chmod after the bind would leave a
    // moment in which another user could connect (the directory is 0711).
    // `serve` is single-threaded here, so the process-wide umask is ours.
    let previous = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let bound = UnixListener::bind(socket);
    nix::sys::stat::umask(previous);
    let listener = bound.map_err(RuntimeError::io("bind", socket))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .map_err(RuntimeError::io("chmod", socket))?;
    let result = serve_on(reg, &listener);
    crate::diag::warn_on_err(None, "removing the socket", std::fs::remove_file(socket));
    result
}

/// One connection: its socket (non-blocking) and the start of a request line
/// not complete yet.
struct Client {
    stream: UnixStream,
    partial: Vec<u8>,
}

impl Client {
    /// Read what the client sent and answer each complete line. `false` when
    /// the connection is to be closed (the client closed it, or broke the
    /// protocol, or cannot be written to).
    fn serve(&mut self, reg: &Registry, idle: &mut IdleWork) -> bool {
        let mut chunk = [0u8; 4096];
        // A client may send its last request and close its side at once: what
        // it sent is answered before its connection is closed.
        let mut closed = false;
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(n) => self.partial.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return false,
            }
        }
        while let Some(end) = self.partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            if line.trim().is_empty() {
                continue;
            }
            let (answer, follow_up) = match handle(reg, line.trim(), idle) {
                Ok(done) => done,
                Err(e) => (error_answer(&e), FollowUp::default()),
            };
            // The rest of the bookkeeping follows once the server is idle
            // (also when the client has gone).
            idle.add(follow_up);
            if !self.answer(&answer) {
                return false;
            }
        }
        if closed {
            return false;
        }
        if self.partial.len() > MAX_LINE {
            // The connection is closed right after, answered or not.
            let _ = self.answer(&error_answer(&RuntimeError::InvalidInput(format!(
                "request line longer than {MAX_LINE} bytes"
            ))));
            return false;
        }
        true
    }

    /// Write one answer line. Answers are small: one fits the socket's
    /// buffer unless the client has stopped reading its answers, and such a
    /// client is dropped (`false`).
    fn answer(&mut self, answer: &Value) -> bool {
        let mut text = answer.to_string();
        text.push('\n');
        self.stream.write_all(text.as_bytes()).is_ok()
    }
}

/// The answer to a request that failed: its one-line message, its kind and the
/// box it concerns, if any.
fn error_answer(e: &RuntimeError) -> Value {
    let mut answer = json!({
        "ok": false,
        "error": e.to_string().replace('\n', " "),
        "kind": e.kind(),
    });
    if let Some(name) = e.box_name() {
        answer["box"] = json!(name);
    }
    answer
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
    listener
        .set_nonblocking(true)
        .map_err(RuntimeError::io("set_nonblocking", "listening socket"))?;
    let mut clients: Vec<Client> = Vec::new();
    let mut idle = IdleWork::default();
    loop {
        if idle.overdue() {
            idle.finish(reg);
        }
        let (ready, stop, incoming) = {
            let mut fds = vec![
                PollFd::new(signals.as_fd(), PollFlags::POLLIN),
                PollFd::new(listener.as_fd(), PollFlags::POLLIN),
            ];
            fds.extend(
                clients
                    .iter()
                    .map(|c| PollFd::new(c.stream.as_fd(), PollFlags::POLLIN)),
            );
            let timeout = match idle.wait() {
                Some(d) => PollTimeout::try_from(d).unwrap_or(PollTimeout::ZERO),
                None => PollTimeout::NONE,
            };
            match poll(&mut fds, timeout) {
                Ok(0) => {
                    idle.finish(reg);
                    continue;
                }
                Ok(_) => {}
                Err(_) => continue,
            }
            let has = |f: &PollFd<'_>| f.revents().is_some_and(|r| !r.is_empty());
            let ready: Vec<bool> = fds[2..].iter().map(has).collect();
            (ready, has(&fds[0]), has(&fds[1]))
        };
        if stop {
            idle.finish(reg);
            return Ok(());
        }
        let mut index = 0;
        clients.retain_mut(|c| {
            let keep = !ready[index] || c.serve(reg, &mut idle);
            index += 1;
            keep
        });
        if incoming {
            while let Ok((stream, _)) = listener.accept() {
                if clients.len() >= MAX_CLIENTS || stream.set_nonblocking(true).is_err() {
                    continue;
                }
                let mut client = Client {
                    stream,
                    partial: Vec::new(),
                };
                // A client usually sends its request right after connecting:
                // serve it now rather than after one more poll.
                if client.serve(reg, &mut idle) {
                    clients.push(client);
                }
            }
        }
    }
}

/// Answer one request line; what is left to do once the answer is sent comes
/// with it. A clone is claimed through the claim prepared for its template,
/// if there is one and it still holds.
fn handle(reg: &Registry, line: &str, idle: &mut IdleWork) -> Result<(Value, FollowUp)> {
    let req: Value = serde_json::from_str(line)
        .map_err(|e| RuntimeError::InvalidInput(format!("request is not JSON: {e}")))?;
    let field = |k: &str| -> Result<Option<String>> {
        match req.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(RuntimeError::InvalidInput(format!(
                "{k:?} must be a string"
            ))),
        }
    };
    match field("op")?.as_deref() {
        Some("ping") => Ok((json!({"ok": true}), FollowUp::default())),
        Some("clone") => {
            let template = field("template")?
                .ok_or_else(|| RuntimeError::InvalidInput("clone needs \"template\"".into()))?;
            let on_clone_signal = field("on_clone_signal")?
                .map(|s| crate::spec::parse_signal(&s))
                .transpose()?;
            let request = CloneRequest {
                names: field("name")?.into_iter().collect(),
                count: 1,
                limits: None,
                on_clone_signal,
                pooled: false,
                without_network: false,
                network: None,
                disk: None,
                fork_now: false,
                stdio: None,
            };
            idle.want(&template);
            let mut follow_up = FollowUp::default();
            let prepared = match idle.prepared.remove(&template) {
                Some(p) => {
                    let name = request
                        .names
                        .first()
                        .cloned()
                        .unwrap_or_else(crate::registry::generated_name);
                    p.claim(reg, &name, &request, &mut follow_up)?
                }
                None => None,
            };
            let made = match prepared {
                Some(c) => vec![c],
                None => {
                    let (made, more) = clone_template_answer_first(reg, &template, &request)?;
                    follow_up.absorb(more);
                    made
                }
            };
            let Some(c) = made.first() else {
                follow_up.finish(reg)?;
                return Err(RuntimeError::Failed("no clone was made".into()));
            };
            let answer = json!({"ok": true, "name": c.name, "pid": c.pid, "address": c.address});
            Ok((answer, follow_up))
        }
        Some(op) => Err(RuntimeError::InvalidInput(format!("unknown op {op:?}"))),
        None => Err(RuntimeError::InvalidInput("request needs \"op\"".into())),
    }
}
