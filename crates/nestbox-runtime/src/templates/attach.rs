//! Monitors attached to and detached from a running box (`nestbox monitor
//! attach|detach|ls`).
//!
//! `attach` forks a detached server process (named `nestbox-attach`,
//! logging to `monitors-attached.log` in the box's run directory). Under the
//! box's clone lock, the server gives every process of the box but its init
//! the monitor filter (`nestbox_remote::install_listener`: seized, the
//! filter installed on all its threads by an injected `seccomp(2)`, let go),
//! keeps the listener of each and answers them all with one stack (a thread
//! per listener), until the box's init ends. Processes forked later inherit
//! the filter of their parent and so its listener. The server listens on
//! `monitors-attached.sock` for `detach` (switch to pass-through: every call
//! is let through unasked, nothing is logged) and for a new `attach` on the
//! same filter. A filter cannot be removed, and the kernel allows one
//! listener per filter chain: one server per box, for the box's life.
//!
//! What the server does is recorded in `monitors-attached.json` (what `ls`
//! shows). A failure halfway (the 2nd of 3 processes) is not undone (a filter
//! cannot be), it is switched off: the processes already done are served
//! pass-through and the error says so.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

use nix::fcntl::OFlag;
use nix::unistd::{fork, pipe2, ForkResult};
use serde::{Deserialize, Serialize};

use crate::registry::{BoxRecord, Registry};
use crate::state::Status;
use crate::{Result, RuntimeError};

/// How many rounds of "list the box's processes, attach to the new ones"
/// before giving up on a box that forks faster than it is attached to.
const ROUNDS: usize = 20;

/// What `monitor ls` shows: the stack attached to a box.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Attached {
    /// The `--monitor` texts of the stack, in order.
    pub monitors: Vec<String>,
    /// `attached` (interposing) or `detached` (pass-through).
    pub state: String,
    /// The calls the filter stops (x86_64 numbers): what a new attach on
    /// the same filter may subscribe to.
    pub subscribed: Vec<u32>,
    /// The host pids of the processes the filter was attached to (their
    /// later children inherit it).
    pub processes: Vec<i32>,
    /// Whether every process of the box got the filter (false after a
    /// failure halfway: such a stack is never switched on again).
    pub complete: bool,
    /// The host pid of the server.
    pub server_pid: i32,
    /// The server's log.
    pub log: PathBuf,
}

fn state_path(record: &BoxRecord) -> PathBuf {
    record.run_dir().join("monitors-attached.json")
}

fn socket_path(record: &BoxRecord) -> PathBuf {
    record.run_dir().join("monitors-attached.sock")
}

fn log_path(record: &BoxRecord) -> PathBuf {
    record.run_dir().join("monitors-attached.log")
}

/// The stack attached to `record`'s box, if a server for it lives.
pub fn attached(record: &BoxRecord) -> Option<Attached> {
    let text = std::fs::read_to_string(state_path(record)).ok()?;
    let a: Attached = serde_json::from_str(&text).ok()?;
    alive(a.server_pid).then_some(a)
}

/// Whether `pid` is a live attached-monitor server.
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == SERVER_NAME)
}

/// The server's process name (15 bytes at most: the kernel's limit).
const SERVER_NAME: &str = "nestbox-attach";

fn write_state(record: &BoxRecord, a: &Attached) -> Result<()> {
    crate::state::write_json(&state_path(record), a)
}

/// The host pid of the box's init, if the box runs (and is not frozen).
fn running_init(name: &str, record: &BoxRecord) -> Result<i32> {
    let init = match (record.state.effective_status(), record.state.init) {
        (Status::Running | Status::Frozen, Some(p)) if p.alive() => p.pid,
        _ => return Err(RuntimeError::NotRunning(name.to_string())),
    };
    if record.state.effective_status() == Status::Frozen || record.state.template.is_some() {
        return Err(RuntimeError::WrongState {
            name: name.to_string(),
            problem: "is frozen (a template): monitors cannot be attached to its processes".into(),
        });
    }
    Ok(init)
}

/// A stack given to `attach`, split: the call monitors and the packet
/// inspector.
struct Parsed {
    /// The `--monitor` texts of the call monitors, in order.
    calls: Vec<String>,
    /// The calls they subscribe to (x86_64 numbers).
    subscribed: Vec<u32>,
    /// The packet inspector (`packets:`; the last one given), if any.
    packets: Option<nestbox_interpose::MonitorSpec>,
}

/// The specs parsed: a bad one is refused before anything is done.
fn parse_specs(specs: &[String]) -> Result<Parsed> {
    if specs.is_empty() {
        return Err(RuntimeError::InvalidInput(
            "monitor attach: give at least one --monitor".into(),
        ));
    }
    let parsed: Vec<nestbox_interpose::MonitorSpec> = specs
        .iter()
        .map(|m| nestbox_interpose::MonitorSpec::parse(m))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| RuntimeError::InvalidInput(e.to_string()))?;
    let (packets, calls) = nestbox_interpose::split_packets(specs);
    Ok(Parsed {
        calls,
        subscribed: nestbox_interpose::subscribed(&parsed),
        packets,
    })
}

/// The packet inspector looks at a bridged box's own network namespace:
/// refused (in one line, naming the monitor) for any other box.
fn check_packets(specs: &[String], record: &BoxRecord) -> Result<()> {
    let mode = &record.spec.network.mode;
    match specs.iter().rev().find(|t| {
        nestbox_interpose::MonitorSpec::parse(t).is_ok_and(|m| m.is_packets())
    }) {
        Some(text) if *mode != crate::spec::NetworkMode::Bridge => {
            Err(RuntimeError::InvalidInput(format!(
                "monitor attach --monitor {text}: the packet inspector needs a box with --network bridge (box {:?} has --network {}: no network namespace of its own with a bridge to inspect)",
                record.name(),
                if *mode == crate::spec::NetworkMode::Host { "host" } else { "none" }
            )))
        }
        _ => Ok(()),
    }
}

/// Attach the stack `specs` (`--monitor` texts) to the running box `name`.
/// Returns what is attached. Forks the server: call it from a
/// single-threaded process (the CLI).
pub fn attach(reg: &Registry, name: &str, specs: &[String]) -> Result<Attached> {
    let subscribed = parse_specs(specs)?.subscribed;
    let record = reg.load(name).map_err(|e| e.in_box(name))?;
    let init = running_init(name, &record)?;
    check_packets(specs, &record)?;
    if !record.spec.monitors.is_empty() {
        return Err(RuntimeError::Unsupported {
            name: name.to_string(),
            problem: "runs under monitors from its start (--monitor): the kernel allows one monitor filter with a listener, no other can be attached".into(),
        });
    }
    if let Some(a) = attached(&record) {
        if a.state == "attached" {
            return Err(RuntimeError::WrongState {
                name: name.to_string(),
                problem: format!(
                    "already has monitors attached ({}): detach them first",
                    a.monitors.join(" ")
                ),
            });
        }
        if !a.complete {
            return Err(RuntimeError::Unsupported {
                name: name.to_string(),
                problem: "keeps a monitor filter attached to only some of its processes (an attach that failed halfway): no stack can be attached again".into(),
            });
        }
        // Detached: its filter stays, and the kernel allows no second one
        // with a listener. A new stack is served on it, if it subscribes
        // to no call the filter does not stop.
        let missing: Vec<String> = subscribed
            .iter()
            .filter(|nr| !a.subscribed.contains(nr))
            .map(|&nr| nestbox_seccomp::syscall_name(nr).unwrap_or("?").to_string())
            .collect();
        if !missing.is_empty() {
            return Err(RuntimeError::Unsupported {
                name: name.to_string(),
                problem: format!(
                    "keeps the monitor filter of an earlier attach, which does not stop {} (a filter cannot be removed): a new stack may subscribe only to the calls it stops",
                    missing.join(",")
                ),
            });
        }
        let line = format!(
            "attach {}",
            serde_json::to_string(specs).map_err(|e| RuntimeError::Failed(e.to_string()))?
        );
        ask(&record, &line)?;
        return attached(&record).ok_or_else(|| {
            RuntimeError::Failed(format!("the monitor server of box {name:?} ended"))
        });
    }
    spawn_server(&record, init, specs, subscribed)?;
    attached(&record)
        .ok_or_else(|| RuntimeError::Failed(format!("the monitor server of box {name:?} ended")))
}

/// Switch the stack attached to box `name` to pass-through, and take the
/// packet inspector's rules out. A server with no call filter to keep (the
/// packet inspector alone) ends: what it served is returned, `detached`.
pub fn detach(reg: &Registry, name: &str) -> Result<Attached> {
    let record = reg.load(name).map_err(|e| e.in_box(name))?;
    running_init(name, &record)?;
    match attached(&record) {
        Some(a) if a.state == "attached" => {
            ask(&record, "detach")?;
            match attached(&record) {
                Some(now) => Ok(now),
                None if a.processes.is_empty() => Ok(Attached {
                    state: "detached".into(),
                    ..a
                }),
                None => Err(RuntimeError::Failed(format!(
                    "the monitor server of box {name:?} ended"
                ))),
            }
        }
        _ => Err(RuntimeError::WrongState {
            name: name.to_string(),
            problem: "has no monitors attached".into(),
        }),
    }
}

/// What is attached to box `name`.
pub fn list(reg: &Registry, name: &str) -> Result<Option<Attached>> {
    let record = reg.load(name).map_err(|e| e.in_box(name))?;
    Ok(attached(&record))
}

/// Whether `record`'s box carries an attached monitor filter (it cannot be
/// frozen, cloned, checkpointed or moved then).
pub(crate) fn has_attached(record: &BoxRecord) -> bool {
    attached(record).is_some()
}

/// One request to the box's server; its answer `ok`, or its error.
fn ask(record: &BoxRecord, line: &str) -> Result<()> {
    let path = socket_path(record);
    let mut s = UnixStream::connect(&path).map_err(RuntimeError::io("connect", &path))?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    writeln!(s, "{line}").map_err(RuntimeError::io("write", &path))?;
    let mut answer = String::new();
    BufReader::new(s)
        .read_line(&mut answer)
        .map_err(RuntimeError::io("read", &path))?;
    match answer.trim_end().strip_prefix("error ") {
        None if answer.trim_end() == "ok" => Ok(()),
        None => Err(RuntimeError::Failed(format!(
            "the monitor server of box {:?} did not answer",
            record.name()
        ))),
        Some(e) => Err(RuntimeError::InvalidInput(e.to_string())),
    }
}

/// Fork the server and wait for its report: `ok`, or `CODE\tmessage`.
fn spawn_server(
    record: &BoxRecord,
    init: i32,
    specs: &[String],
    subscribed: Vec<u32>,
) -> Result<()> {
    let (ready_r, ready_w) = pipe2(OFlag::O_CLOEXEC).map_err(RuntimeError::sys("pipe2"))?;
    // SAFETY: the CLI is single-threaded, so the child may run arbitrary code.
    match unsafe { fork() }.map_err(RuntimeError::sys("fork the monitor server"))? {
        ForkResult::Child => {
            drop(ready_r);
            let keep = ready_w.as_raw_fd() as u32;
            // SAFETY: this child never returns to its callers (it ends with
            // exit), so no object up the stack uses a closed descriptor
            // again; `ready_w` is kept.
            let closed = unsafe {
                crate::process::close_fds(3, keep.saturating_sub(1))
                    .and_then(|()| crate::process::close_fds_from(keep + 1))
            };
            crate::diag::descriptors_closed();
            crate::process::become_daemon();
            crate::diag::to_file(log_path(record), false);
            let _ = nix::sys::prctl::set_name(c"nestbox-attach");
            let mut ready = std::fs::File::from(ready_w);
            if let Err(e) = closed {
                let _ = write!(ready, "{}\t{e}", e.exit_code());
                std::process::exit(1);
            }
            let code = server(record, init, specs, subscribed, ready);
            std::process::exit(code)
        }
        ForkResult::Parent { child } => {
            drop(ready_w);
            let mut text = String::new();
            let _ = std::fs::File::from(ready_r).read_to_string(&mut text);
            if text == "ok" {
                return Ok(());
            }
            // A server that failed before attaching anything exits: reap it.
            if !alive(child.as_raw()) {
                let _ = nix::sys::wait::waitpid(child, Some(nix::sys::wait::WaitPidFlag::WNOHANG));
            }
            match text.split_once('\t') {
                Some((_, msg)) => Err(RuntimeError::InvalidInput(msg.to_string())),
                None => Err(RuntimeError::Failed(format!(
                    "the monitor server of box {:?} died before it reported",
                    record.name()
                ))),
            }
        }
    }
}

/// The server: attach, report on `ready`, serve until the box's init ends.
/// Its exit status.
fn server(
    record: &BoxRecord,
    init: i32,
    specs: &[String],
    subscribed: Vec<u32>,
    mut ready: std::fs::File,
) -> i32 {
    let name = record.name().to_string();
    let fail = |ready: &mut std::fs::File, e: &RuntimeError| {
        tracing::error!(box_name = %name, "monitor attach: {e}");
        let _ = write!(ready, "{}\t{e}", e.exit_code());
        1
    };
    let init_pidfd = match crate::process::pidfd_open(init) {
        Ok(p) => p,
        Err(e) => return fail(&mut ready, &e),
    };
    let lock = match crate::clone::box_lock(record) {
        Ok(l) => l,
        Err(e) => return fail(&mut ready, &e),
    };
    // Another attach may have served the box while this one waited for
    // the lock.
    if let Some(a) = attached(record) {
        let e = RuntimeError::WrongState {
            name: name.clone(),
            problem: format!(
                "already has monitors attached ({}): detach them first",
                a.monitors.join(" ")
            ),
        };
        return fail(&mut ready, &e);
    }
    let parsed = match parse_specs(specs) {
        Ok(p) => p,
        Err(e) => return fail(&mut ready, &e),
    };
    let stack =
        match nestbox_interpose::Stack::open(&parsed.calls, &crate::monitor::trace_log(record)) {
            Ok(s) => s,
            Err(e) => return fail(&mut ready, &RuntimeError::InvalidInput(e.to_string())),
        };
    let shared = nestbox_interpose::Shared::new(stack);
    // The packet inspector first: it is undone whole (its rules taken out)
    // if the calls cannot be attached.
    let mut reader = None;
    if let Some(p) = &parsed.packets {
        if let Err(e) = inspect_packets(&mut reader, init, p, record) {
            return fail(&mut ready, &e);
        }
    }
    let (listeners, error) = if parsed.calls.is_empty() {
        (Vec::new(), None)
    } else {
        attach_all(record, init, &subscribed)
    };
    if error.is_some() {
        stop_packets(reader.as_ref(), record);
    }
    if let (true, Some(e)) = (listeners.is_empty(), &error) {
        drop(lock);
        return fail(&mut ready, e);
    }
    let mut state = Attached {
        monitors: specs.to_vec(),
        state: "attached".into(),
        subscribed,
        processes: listeners.iter().map(|(p, _)| *p).collect(),
        complete: error.is_none(),
        server_pid: std::process::id() as i32,
        log: log_path(record),
    };
    let control = match bind_control(record) {
        Ok(c) => c,
        Err(e) => {
            // The listeners must live: pass-through for the box's life,
            // recorded as a stack that cannot be switched on again (no
            // socket to ask it).
            shared.pass_through();
            stop_packets(reader.as_ref(), record);
            state.state = "detached".into();
            state.complete = false;
            if let Err(w) = write_state(record, &state) {
                tracing::warn!(box_name = %name, "monitor attach: {w}");
            }
            tracing::error!(box_name = %name, "monitor attach: {e}: the box is served pass-through");
            let _ = write!(ready, "{}\t{e}", e.exit_code());
            drop(ready);
            drop(lock);
            serve_until_end(&shared, listeners, None, &init_pidfd, record);
            return 1;
        }
    };
    if let Some(e) = &error {
        shared.pass_through();
        state.state = "detached".into();
        let _ = write_state(record, &state);
        drop(lock);
        let msg = format!(
            "monitors attached to {} of the box's processes only (a filter cannot be removed: those are served pass-through until the box ends): {e}",
            state.processes.len()
        );
        tracing::error!(box_name = %name, "monitor attach: {msg}");
        let _ = write!(ready, "{}\t{msg}", e.exit_code());
    } else {
        if let Err(e) = write_state(record, &state) {
            tracing::warn!(box_name = %name, "monitor attach: {e}");
        }
        drop(lock);
        tracing::info!(box_name = %name, "monitors attached to {:?}: {}", state.processes, specs.join(" "));
        let _ = ready.write_all(b"ok");
    }
    drop(ready);
    let served = Control {
        state,
        packets: reader,
        init,
    };
    serve_until_end(
        &shared,
        listeners,
        Some((control, served)),
        &init_pidfd,
        record,
    );
    0
}

/// Start judging the box's packets with `spec` (`packets:…`): on the
/// reader in `slot`, or on one bound now in the network namespace of
/// `init` (and kept in `slot`).
fn inspect_packets(
    slot: &mut Option<crate::network::packets::Reader>,
    init: i32,
    spec: &nestbox_interpose::MonitorSpec,
    record: &BoxRecord,
) -> Result<()> {
    let inspector =
        nestbox_interpose::packets::Inspector::open(spec, &crate::monitor::trace_log(record))
            .map_err(|e| RuntimeError::InvalidInput(e.to_string()))?;
    let reader = match slot {
        Some(r) => r,
        None => slot.insert(crate::network::packets::Reader::bind(init)?),
    };
    reader.inspect(spec, inspector)
}

/// Take the packet inspector's rules out, if it has any; a failure is
/// logged (the rules that could not be taken out stay, and the packets they
/// queue are still judged by the inspector).
fn stop_packets(reader: Option<&crate::network::packets::Reader>, record: &BoxRecord) {
    if let Some(r) = reader {
        if let Err(e) = r.stop() {
            tracing::error!(
                box_name = record.name(),
                "packet inspector: taking its rules out: {e}"
            );
        }
    }
}

/// What the control socket's thread holds besides the socket.
struct Control {
    state: Attached,
    /// The packet queue's reader, once a stack had the inspector.
    packets: Option<crate::network::packets::Reader>,
    /// The host pid of the box's init (its network namespace).
    init: i32,
}

type Listeners = Vec<(i32, OwnedFd)>;

/// Attach the filter to every process of the box but its init (the oldest
/// first), until a
/// listing of its cgroup finds none left; on an error, the listeners got so
/// far with it (the listeners got, and the error that stopped it).
fn attach_all(
    record: &BoxRecord,
    init: i32,
    subscribed: &[u32],
) -> (Listeners, Option<RuntimeError>) {
    let name = record.name().to_string();
    let remote = |e: nestbox_remote::RemoteError| RuntimeError::Remote {
        what: "attaching monitors to box",
        name: name.clone(),
        source: e,
    };
    let cookie = match crate::monitor::new_setns_cookie() {
        Ok(c) => c,
        Err(e) => return (Vec::new(), Some(e)),
    };
    let program = match nestbox_seccomp::monitor_profile(subscribed, cookie).compile() {
        Ok(p) => p,
        Err(e) => return (Vec::new(), Some(e.into())),
    };
    let procs = |done: &Listeners| -> Result<Vec<i32>> {
        let all = match &record.state.cgroup {
            Some(c) => c.procs()?,
            None => Vec::new(),
        };
        // Oldest first: a parent before the children it forked.
        let mut left: Vec<(u64, i32)> = all
            .into_iter()
            .filter(|&p| p != init && !done.iter().any(|(d, _)| *d == p))
            .map(|p| (crate::liveness::start_time(p).unwrap_or(u64::MAX), p))
            .collect();
        left.sort_unstable();
        Ok(left.into_iter().map(|(_, p)| p).collect())
    };
    let mut done: Listeners = Vec::new();
    // Checked before anything is done: a refusal leaves the box as it was.
    let first = match procs(&done) {
        Ok(p) => p,
        Err(e) => return (done, Some(e)),
    };
    if first.is_empty() {
        return (
            done,
            Some(RuntimeError::Unsupported {
                name: name.clone(),
                problem: "has no process but its init: nothing to monitor".into(),
            }),
        );
    }
    for &pid in &first {
        if let Err(e) = nestbox_remote::check_attachable(pid) {
            if !matches!(e, nestbox_remote::RemoteError::NoSuchProcess { .. }) {
                return (done, Some(remote(e)));
            }
        }
    }
    let mut todo = first;
    for _ in 0..ROUNDS {
        if todo.is_empty() {
            return (done, None);
        }
        for pid in todo {
            match nestbox_remote::install_listener(pid, program.instructions()) {
                Ok(fd) => done.push((pid, fd)),
                // Gone meanwhile: nothing to monitor.
                Err(nestbox_remote::RemoteError::NoSuchProcess { .. }) => {}
                Err(e) => return (done, Some(remote(e))),
            }
        }
        // A child forked while its parent was being seized is traced by
        // us: let it go, so the next listing attaches to it.
        if let Ok(all) = procs(&Vec::new()) {
            let strays = nestbox_remote::let_go_of_strays(&all);
            if strays > 0 {
                tracing::info!(box_name = %name, "let go of {strays} process(es) forked during the attach");
            }
        }
        todo = match procs(&done) {
            Ok(p) => p,
            Err(e) => return (done, Some(e)),
        };
    }
    (
        done,
        Some(RuntimeError::Failed(format!(
            "box {name:?} made new processes faster than monitors could be attached to them"
        ))),
    )
}

fn bind_control(record: &BoxRecord) -> Result<UnixListener> {
    let path = socket_path(record);
    let _ = std::fs::remove_file(&path);
    let l = UnixListener::bind(&path).map_err(RuntimeError::io("bind", &path))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .map_err(RuntimeError::io("chmod", &path))?;
    Ok(l)
}

/// Serve every listener in a thread of its own and the control socket in
/// another, until the box's init ends; then remove the socket and the state.
fn serve_until_end(
    shared: &nestbox_interpose::Shared,
    listeners: Listeners,
    control: Option<(UnixListener, Control)>,
    init: &OwnedFd,
    record: &BoxRecord,
) {
    for (pid, fd) in listeners {
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("monitors {pid}"))
            .spawn(move || nestbox_interpose::serve_shared(fd, &s));
        if let Err(e) = spawned {
            // Its listener is closed with the closure: its subscribed calls
            // fail with ENOSYS from now on.
            tracing::error!("monitors: no thread for the listener of {pid}: {e}");
        }
    }
    if let Some((listener, control)) = control {
        let s = shared.clone();
        let rec = record.clone();
        let spawned = std::thread::Builder::new()
            .name("monitors control".into())
            .spawn(move || control_loop(&listener, control, &s, &rec));
        if let Err(e) = spawned {
            tracing::error!("monitors: no thread for the control socket (detach): {e}");
        }
    }
    loop {
        match nestbox_sys::pidfd::wait_ended(init.as_fd(), None) {
            Ok(true) => break,
            Ok(false) | Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                tracing::error!("monitors: waiting for the box's init: {e}");
                break;
            }
        }
    }
    tracing::info!(
        box_name = record.name(),
        "the box ended: the monitor server ends"
    );
    let _ = std::fs::remove_file(socket_path(record));
    let _ = std::fs::remove_file(state_path(record));
}

/// Answer `detach` and `attach [SPECS…]` requests, one line each. After a
/// `detach` that leaves nothing to serve (no call filter), the server ends.
fn control_loop(
    listener: &UnixListener,
    mut control: Control,
    shared: &nestbox_interpose::Shared,
    record: &BoxRecord,
) {
    for conn in listener.incoming() {
        let mut conn = match conn {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("monitors: accepting a request: {e}");
                continue;
            }
        };
        let mut line = String::new();
        let read = conn
            .try_clone()
            .and_then(|c| BufReader::new(c).read_line(&mut line));
        if let Err(e) = read {
            tracing::warn!("monitors: reading a request: {e}");
            continue;
        }
        let answer = handle(line.trim_end(), shared, &mut control, record);
        if let Err(e) = &answer {
            tracing::warn!("monitors: {}: {e}", line.trim_end());
        }
        let ends = line.trim_end() == "detach" && control.state.processes.is_empty();
        if ends {
            // Nothing of the attach is left in the box: no filter, the
            // packet rules out. Gone before the answer, so that `detach`
            // reads that it ended.
            let _ = std::fs::remove_file(socket_path(record));
            let _ = std::fs::remove_file(state_path(record));
        }
        let text = match answer {
            Ok(()) => "ok\n".to_string(),
            Err(e) => format!("error {}\n", e.replace('\n', " ")),
        };
        if let Err(e) = conn.write_all(text.as_bytes()) {
            tracing::warn!("monitors: answering a request: {e}");
        }
        if ends {
            tracing::info!(
                box_name = record.name(),
                "monitors detached, nothing left to serve: the monitor server ends"
            );
            std::process::exit(0);
        }
    }
}

fn handle(
    line: &str,
    shared: &nestbox_interpose::Shared,
    control: &mut Control,
    record: &BoxRecord,
) -> std::result::Result<(), String> {
    let state = &mut control.state;
    if line == "detach" {
        shared.pass_through();
        state.state = "detached".into();
        if let Some(r) = &control.packets {
            r.stop().map_err(|e| e.to_string())?;
        }
        tracing::info!(box_name = record.name(), "monitors detached: pass-through");
    } else if let Some(json) = line.strip_prefix("attach ") {
        let specs: Vec<String> = serde_json::from_str(json).map_err(|e| e.to_string())?;
        let parsed = parse_specs(&specs).map_err(|e| e.to_string())?;
        let stack =
            nestbox_interpose::Stack::open(&parsed.calls, &crate::monitor::trace_log(record))
                .map_err(|e| e.to_string())?;
        if let Some(p) = &parsed.packets {
            inspect_packets(&mut control.packets, control.init, p, record)
                .map_err(|e| e.to_string())?;
        }
        shared.replace(stack);
        state.monitors = specs;
        state.state = "attached".into();
        tracing::info!(
            box_name = record.name(),
            "monitors attached again: {}",
            state.monitors.join(" ")
        );
    } else {
        return Err(format!("unknown request {line:?}"));
    }
    write_state(record, state).map_err(|e| e.to_string())
}
