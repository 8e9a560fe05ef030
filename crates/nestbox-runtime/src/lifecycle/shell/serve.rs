//! The monitor of a pooled shell: it makes the shell (as a box's monitor
//! starts a box, with an init that waits for a command), listens for one
//! claim, turns the shell into the claiming box, and from then on is that
//! box's monitor. Unclaimed, it tears the shell down when its init dies,
//! when it is drained or signalled, when the shell's shape is no longer
//! wanted, when its record is gone, or after [`super::IDLE_TTL`].

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use nestbox_sys::process::{set_scheduling, Scheduling};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{kill, Signal};
use nix::sys::signalfd::SignalFd;

use super::wire::{self, FromMonitor, Go, Stdio, ToMonitor};
use super::{Shape, MAKING_PREFIX, READY_PREFIX, SOCKET};
use crate::monitor::{Outcome, Running};
use crate::registry::{BoxRecord, Registry};
use crate::spec::{BoxSpec, NetworkMode};
use crate::state::{now, Status};
use crate::{Result, RuntimeError};

/// How a waiting shell's monitor shows in `ps`; once claimed, [`MONITOR_TITLE`].
const SHELL_TITLE: &str = "nestbox-shell";
const MONITOR_TITLE: &str = "nestbox-monitor";

/// How often an unclaimed shell checks that it is still wanted.
const CHECK_EVERY: Duration = Duration::from_secs(5);

/// How long a claimed box runs before its shell's refill starts (unless it
/// ends first: then right after its caller is answered).
const REFILL_AFTER: Duration = Duration::from_millis(50);

/// How long a caller that connected may take to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// A claim accepted: the shell's record is now the box's.
struct Claim {
    conn: OwnedFd,
    spec: BoxSpec,
    inherited: wire::Inherited,
    detach: bool,
    stdio: Vec<(Stdio, OwnedFd)>,
    marks: Marks,
}

/// The phase marks a claimer asked for (`NESTBOX_PHASES`), sent back to it.
#[derive(Default)]
struct Marks(Option<Vec<(String, i32, u64)>>, Option<File>);

impl Marks {
    /// Add what init and the command wrote on the marks pipe until now (it
    /// is non-blocking).
    fn collect(&mut self) {
        let (Some(m), Some(pipe)) = (self.0.as_mut(), self.1.as_mut()) else {
            return;
        };
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(pipe, &mut text);
        for line in text.lines() {
            let mut parts = line.splitn(3, ' ');
            if let (Some(pid), Some(ns), Some(name)) = (parts.next(), parts.next(), parts.next()) {
                if let (Ok(pid), Ok(ns)) = (pid.parse(), ns.parse()) {
                    m.push((name.to_string(), pid, ns));
                }
            }
        }
    }
    fn mark(&mut self, name: &str) {
        if let Some(m) = &mut self.0 {
            m.push((
                format!("shell monitor: {name}"),
                std::process::id() as i32,
                crate::phases::now_ns(),
            ));
        }
    }
    fn take(&mut self) -> Vec<(String, i32, u64)> {
        self.0.as_mut().map(std::mem::take).unwrap_or_default()
    }
}

/// Why an unclaimed shell ends.
enum End {
    /// Its init died, it was signalled, it is not wanted any more.
    Quietly,
    /// `pool drain` asked: answer it once the shell is gone.
    Drained(OwnedFd),
}

/// Run the monitor of the shell `record` (named `pool.mk.KEY.SUFFIX`):
/// report "ok" on `ready` once it waits under its ready name, or the error.
pub(crate) fn run(
    reg: &Registry,
    record: &BoxRecord,
    ready: OwnedFd,
    signals: SignalFd,
) -> Result<Outcome> {
    let mut ready = File::from(ready);
    // The shell's monitor is this process from the start (not the refill
    // that made the record), so that the record is not taken for a dead
    // box's should the refill die.
    reg.update(record.name(), |s| {
        s.monitor = Some(crate::liveness::ProcRef::current())
    })?;
    let report = |ready: &mut File, e: &RuntimeError| {
        // The refill that waits for the shell may have gone: nobody to tell.
        let _ = write!(ready, "{}\t{}", e.exit_code(), e);
    };
    let running = match crate::monitor::start(reg, record, true, false, true) {
        Ok(r) => r,
        Err(e) => {
            report(&mut ready, &e);
            return Err(e);
        }
    };
    let key = super::key_of_name(record.name())
        .unwrap_or_default()
        .to_string();
    let listening = (|| -> Result<(OwnedFd, BoxRecord)> {
        let listener = super::listen(record.run_dir())
            .map_err(|e| RuntimeError::Failed(format!("listening for claims: {e}")))?;
        let suffix = record
            .name()
            .strip_prefix(MAKING_PREFIX)
            .unwrap_or_default();
        let ready_name = format!("{READY_PREFIX}{suffix}");
        reg.rename(record.name(), &ready_name)?;
        Ok((listener, reg.load(&ready_name)?))
    })();
    let (listener, record) = match listening {
        Ok(x) => x,
        Err(e) => {
            report(&mut ready, &e);
            teardown(reg, record, running);
            return Err(e);
        }
    };
    // Made at idle priority (a refill); claimed, it must answer at once.
    normal_priority();
    // Its command line is that of the command that started the refill (any
    // box's `nestbox run …`): say what it is instead.
    crate::init::set_process_title(SHELL_TITLE);
    // The refill may have gone; the shell waits all the same.
    let _ = ready.write_all(b"ok");
    drop(ready);
    match wait(reg, &record, &running, &listener, &signals, &key) {
        Ok(claim) => {
            drop(listener);
            let name = claim.spec.name.clone();
            // From here on the box is `name`'s: its errors are logged under
            // that name (and only once: the caller logs none of ours).
            serve_claimed(reg, &record, running, signals, claim, &key).or_else(|e| {
                tracing::error!(box_name = name.as_str(), "{e}");
                Ok(Outcome {
                    exit_code: e.exit_code(),
                    oom_killed: false,
                })
            })
        }
        Err(end) => {
            drop(listener);
            teardown(reg, &record, running);
            if let End::Drained(conn) = end {
                // The drainer may have gone.
                let _ = wire::send(conn.as_fd(), &FromMonitor::Drained, &[]);
            }
            Ok(Outcome {
                exit_code: 0,
                oom_killed: false,
            })
        }
    }
}

fn normal_priority() {
    // Failing leaves the monitor at idle priority: slower, not wrong.
    let _ = set_scheduling(Scheduling::Normal(0));
}

/// Remove an unclaimed shell: its init, cgroup, address, record.
fn teardown(reg: &Registry, record: &BoxRecord, running: Running) {
    // Our own child: ESRCH only if it died already.
    let _ = kill(running.init, Signal::SIGKILL);
    let code = crate::process::wait_exit_code(running.init);
    let mut record = record.clone();
    record.spec.remove_on_exit = true;
    let done = crate::monitor::finish(reg, &record, running, code);
    crate::diag::warn_on_err(Some(record.name()), "removing the shell", done.map(|_| ()));
}

/// Wait for a claim; `Err` when the shell should end instead.
fn wait(
    reg: &Registry,
    record: &BoxRecord,
    running: &Running,
    listener: &OwnedFd,
    signals: &SignalFd,
    key: &str,
) -> std::result::Result<Claim, End> {
    // An idle shell keeps its pages (unlike an idle box's monitor, see
    // `residency`): faulting the code of the claim back in would cost the
    // claim about half a millisecond, and a pool holds a few shells only.
    let since = Instant::now();
    loop {
        let mut fds = [
            PollFd::new(listener.as_fd(), PollFlags::POLLIN),
            PollFd::new(running.pidfd.as_fd(), PollFlags::POLLIN),
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
        ];
        let timeout = PollTimeout::try_from(CHECK_EVERY).unwrap_or(PollTimeout::MAX);
        match poll(&mut fds, timeout) {
            Err(_) => continue,
            Ok(0) => {
                if since.elapsed() >= super::IDLE_TTL
                    || !record.run_dir().exists()
                    || !super::wanted(reg.roots(), key)
                {
                    return Err(End::Quietly);
                }
                continue;
            }
            Ok(_) => {}
        }
        let [claim, init, signal] = fds.map(|f| f.revents().is_some_and(|r| !r.is_empty()));
        if init {
            return Err(End::Quietly);
        }
        if signal {
            while let Ok(Some(_)) = signals.read_signal() {}
            return Err(End::Quietly);
        }
        if !claim {
            continue;
        }
        let Ok(raw) = nix::sys::socket::accept4(
            listener.as_raw_fd(),
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        ) else {
            continue;
        };
        // SAFETY: accept4 returned a fresh descriptor that nothing else owns.
        let conn = unsafe { OwnedFd::from_raw_fd(raw) };
        // A caller that connects and says nothing does not hold the shell.
        let _ = nix::sys::socket::setsockopt(
            &conn,
            nix::sys::socket::sockopt::ReceiveTimeout,
            &nix::sys::time::TimeVal::new(REQUEST_TIMEOUT.as_secs() as i64, 0),
        );
        let accepted = crate::phases::now_ns();
        match wire::recv::<ToMonitor>(conn.as_fd()) {
            Ok(Some((ToMonitor::Drain, _))) => return Err(End::Drained(conn)),
            Ok(Some((
                ToMonitor::Claim {
                    spec,
                    detach,
                    stdio,
                    phases,
                    inherited,
                },
                fds,
            ))) if stdio.len() == fds.len() => {
                let mut marks = Marks(phases.then(Vec::new), None);
                if let Some(m) = &mut marks.0 {
                    m.push((
                        "shell monitor: claim accepted".into(),
                        std::process::id() as i32,
                        accepted,
                    ));
                }
                marks.mark("claim received");
                match take(reg, record, &conn, &spec, key) {
                    Taken::Yes => {
                        let _ = nix::sys::socket::setsockopt(
                            &conn,
                            nix::sys::socket::sockopt::ReceiveTimeout,
                            &nix::sys::time::TimeVal::new(0, 0),
                        );
                        marks.mark("record renamed");
                        return Ok(Claim {
                            conn,
                            spec: *spec,
                            inherited,
                            detach,
                            stdio: stdio.into_iter().zip(fds).collect(),
                            marks,
                        });
                    }
                    Taken::Keep => continue,
                    Taken::End => return Err(End::Quietly),
                }
            }
            _ => {
                // A request we cannot serve: the caller starts its box cold.
                let _ = wire::send(conn.as_fd(), &FromMonitor::Refused, &[]);
            }
        }
    }
}

enum Taken {
    /// The record is the box's now.
    Yes,
    /// Refused; the shell stays in the pool.
    Keep,
    /// Refused; the shell is broken.
    End,
}

/// Make the shell's record the box's: rename it to the box's name (refused
/// when taken, as a cold start is refused).
fn take(reg: &Registry, record: &BoxRecord, conn: &OwnedFd, spec: &BoxSpec, key: &str) -> Taken {
    let fits = Shape::of(spec).is_some_and(|s| s.key() == key)
        && crate::spec::validate_user_name(&spec.name).is_ok();
    if !fits {
        let _ = wire::send(conn.as_fd(), &FromMonitor::Refused, &[]);
        return Taken::Keep;
    }
    match reg.rename(record.name(), &spec.name) {
        Ok(()) => Taken::Yes,
        Err(e @ RuntimeError::NameInUse(_)) => {
            let _ = wire::send(
                conn.as_fd(),
                &FromMonitor::Failed {
                    code: e.exit_code(),
                    message: e.to_string(),
                    name_in_use: true,
                },
                &[],
            );
            Taken::Keep
        }
        Err(e) => {
            tracing::warn!(box_name = record.name(), "claiming the shell: {e}");
            let _ = wire::send(conn.as_fd(), &FromMonitor::Refused, &[]);
            Taken::End
        }
    }
}

/// Point stdout and stderr at the caller's descriptors (`Some`), or back at
/// `/dev/null`.
fn stdio_to(out: Option<(&OwnedFd, &OwnedFd)>) {
    match out {
        Some((o, e)) => {
            // Failing leaves the output on /dev/null: the log still has it.
            let _ = nix::unistd::dup2(o.as_raw_fd(), 1);
            let _ = nix::unistd::dup2(e.as_raw_fd(), 2);
        }
        None => crate::process::stdio_to_dev_null(),
    }
}

/// The claimed shell: start the command, supervise the box, end it.
fn serve_claimed(
    reg: &Registry,
    shell: &BoxRecord,
    running: Running,
    signals: SignalFd,
    claim: Claim,
    key: &str,
) -> Result<Outcome> {
    let Claim {
        conn,
        spec,
        inherited,
        detach,
        stdio,
        mut marks,
    } = claim;
    let name = spec.name.clone();
    crate::init::set_process_title(MONITOR_TITLE);
    let run_dir = reg.roots().box_run(&name);
    let mut stdin = None;
    let (mut out, mut err) = (None, None);
    for (which, fd) in stdio {
        match which {
            Stdio::Stdin => stdin = Some(fd),
            Stdio::Stdout => out = Some(fd),
            Stdio::Stderr => err = Some(fd),
        }
    }
    let foreground = !detach;
    if let (true, Some(o), Some(e)) = (foreground, &out, &err) {
        stdio_to(Some((o, e)));
    }
    drop((out, err));
    let taken = (!detach).then_some(&conn);
    let started = start_command(
        reg, shell, &running, &spec, inherited, stdin, taken, &mut marks,
    );
    // The listener is closed: its name goes too (off the command's path).
    let _ = std::fs::remove_file(run_dir.join(SOCKET));
    let record = match started {
        Ok(r) => r,
        Err(e) => {
            // As a cold start that fails: nothing of the box is left.
            let _ = kill(running.init, Signal::SIGKILL);
            let code = crate::process::wait_exit_code(running.init);
            let mut gone = shell.clone();
            gone.spec = spec.clone();
            gone.spec.remove_on_exit = true;
            let gone = reg
                .load(&name)
                .map(|mut r| {
                    r.spec.remove_on_exit = true;
                    r
                })
                .unwrap_or(gone);
            let done = crate::monitor::finish(reg, &gone, running, code);
            crate::diag::warn_on_err(Some(&name), "removing the box", done.map(|_| ()));
            stdio_to(None);
            let _ = wire::send(
                conn.as_fd(),
                &FromMonitor::Failed {
                    code: e.exit_code(),
                    message: e.to_string(),
                    name_in_use: false,
                },
                &[],
            );
            return Err(e);
        }
    };
    if detach {
        // The caller may have gone: the box runs anyway.
        let _ = wire::send(
            conn.as_fd(),
            &FromMonitor::Started {
                init_pid: running.init.as_raw(),
                marks: marks.take(),
            },
            &[],
        );
    }
    let claimer = if foreground {
        Some(conn)
    } else {
        drop(conn);
        None
    };
    // The refill (a fork of this monitor) waits until the box has run for a
    // while or has ended and its caller has been answered.
    let refill = {
        let (reg, key) = (reg.clone(), key.to_string());
        crate::monitor::Later {
            at: Instant::now() + REFILL_AFTER,
            work: Box::new(move || {
                super::touch(reg.roots(), &key);
                super::spawn_fill(&reg, &key);
            }),
        }
    };
    let (code, abandoned, refill) = crate::monitor::supervise(
        &record,
        &running,
        signals,
        foreground,
        claimer.as_ref().map(|c| c.as_fd()),
        Some(refill),
        None,
    );
    marks.mark("init exited, output relayed");
    if foreground {
        // The caller's pipes must see their end when it exits.
        stdio_to(None);
    }
    let ended = end_claimed(reg, &record, running, code, abandoned, claimer, marks);
    if let Some(r) = refill {
        (r.work)();
    }
    ended
}

/// Hand the command to the shell's init; `Ok` once it runs (its `execve`
/// succeeded), with the box's record as it is then. What the command could
/// see (its name in the network's hosts file) is written while init prepares
/// the command, which waits for it before its `execve`; the box's spec and
/// state are written while the command starts.
#[allow(clippy::too_many_arguments)]
fn start_command(
    reg: &Registry,
    shell: &BoxRecord,
    running: &Running,
    spec: &BoxSpec,
    inherited: wire::Inherited,
    stdin: Option<OwnedFd>,
    taken: Option<&OwnedFd>,
    marks: &mut Marks,
) -> Result<BoxRecord> {
    let name = &spec.name;
    let bridged = spec.network.mode == NetworkMode::Bridge;
    let (rep_r, rep_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(RuntimeError::sys("pipe2"))?;
    let mut fds = vec![rep_w.as_raw_fd()];
    if let Some(i) = &stdin {
        fds.push(i.as_raw_fd());
    }
    // The marks of init and of the command before its execve, when asked for.
    let trace = match marks.0.is_some() {
        true => {
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK).ok()
        }
        false => None,
    };
    if let Some((_, w)) = &trace {
        fds.push(w.as_raw_fd());
    }
    let hold = match bridged {
        true => Some(
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(RuntimeError::sys("pipe2"))?,
        ),
        false => None,
    };
    if let Some((r, _)) = &hold {
        fds.push(r.as_raw_fd());
    }
    let channel = running
        .shell
        .as_ref()
        .ok_or_else(|| RuntimeError::Failed("the shell has no channel to its init".into()))?;
    let go = Go {
        spec: Box::new(spec.clone()),
        cookie: shell.state.setns_cookie,
        stdin: stdin.is_some(),
        phases: trace.is_some(),
        hold: hold.is_some(),
        inherited,
    };
    wire::send(channel.as_fd(), &go, &fds)
        .map_err(|e| RuntimeError::Failed(format!("the shell's init: {e}")))?;
    drop((rep_w, stdin));
    marks.mark("command sent to init");
    if let Some(conn) = taken {
        // A foreground caller waits for the exit from now on (one gone is
        // seen later). After the command's go-ahead: init runs first.
        let _ = wire::send(conn.as_fd(), &FromMonitor::Taken, &[]);
    }
    if let Some((r, w)) = hold {
        drop(r);
        // Named on its network before its command can look itself up there
        // (the command waits for the byte; an error closes the pipe: it fails).
        if let Some(net) = crate::network::view_named(reg.roots(), spec.network.name.as_deref())? {
            net.rename(&shell.state.id, &spec.host_names())?;
        }
        match nix::unistd::write(&w, b"g") {
            Ok(_) => {}
            // The command is gone: the box was killed meanwhile (an `rm -f`
            // or `stop` of its name racing with its start). Its end is
            // recorded below, as a cold start's box killed right after it
            // started.
            Err(nix::errno::Errno::EPIPE) => {
                tracing::debug!(
                    box_name = name.as_str(),
                    "the command ended before its go-ahead"
                );
            }
            Err(e) => return Err(RuntimeError::sys("let the command go")(e)),
        }
        marks.mark("named in the hosts file, command let go");
    }
    // Meanwhile: the record becomes the box's.
    let run_dir = reg.roots().box_run(name);
    crate::state::write_json(&run_dir.join("spec.json"), spec)?;
    let names: Vec<String> = spec.host_names().iter().map(|s| s.to_string()).collect();
    let state = reg.update(name, |s| {
        s.status = Status::Running;
        s.created_at = now();
        s.started_at = s.created_at.into();
        if let Some(net) = s.network.as_mut() {
            net["names"] = serde_json::json!(names);
        }
    })?;
    marks.mark("spec and state written");
    if let Some((code, message)) = crate::launch::read_report(&rep_r) {
        return Err(RuntimeError::Launch { code, message });
    }
    marks.mark("command exec'd (report closed)");
    if let Some((r, w)) = trace {
        drop(w);
        marks.1 = Some(File::from(r));
        marks.collect();
    }
    Ok(shell.renamed(spec.clone(), state))
}

/// Record the end of a claimed box and release what it holds. The caller
/// is answered as soon as `ps`, `inspect` and `rm` see the end (the record
/// says exited, or with `--rm` it is gone from the listing): releasing the
/// cgroup, the address and the layer follows.
fn end_claimed(
    reg: &Registry,
    record: &BoxRecord,
    running: Running,
    exit_code: i32,
    abandoned: bool,
    claimer: Option<OwnedFd>,
    mut marks: Marks,
) -> Result<Outcome> {
    let name = record.name();
    // As a cold box's monitor: a box frozen into a template that was removed
    // while clones depended on it goes once its init has.
    let removed_template = || {
        reg.load(name)
            .is_ok_and(|r| r.state.template.is_some_and(|t| t.removed))
    };
    let rm = record.spec.remove_on_exit || removed_template();
    let cgroup = running.cgroup.clone();
    let oom_kills = cgroup
        .as_ref()
        .and_then(|c| c.oom_kills().ok())
        .unwrap_or(0);
    let oom_killed = oom_kills > 0 && exit_code == 128 + Signal::SIGKILL as i32;
    let outcome = Outcome {
        exit_code,
        oom_killed,
    };
    // Init said the box ended and exits: gone from the cgroup before it is
    // removed (after the answer: the caller does not wait for it).
    let release = |record: &BoxRecord| {
        running.reap();
        crate::monitor::release_ended(reg, record, cgroup.as_ref())
    };
    if abandoned {
        // Its foreground `run` was killed, and the box with it: as a cold
        // box whose `run` dies, it is dead (gc collects it), or gone (--rm).
        release(record);
        if rm {
            reg.remove(record)?;
        } else {
            reg.update(name, |s| {
                s.status = Status::Dead;
                s.cgroup = None;
                s.finished_at = Some(now());
                s.error = Some("its foreground nestbox run was killed".into());
            })?;
        }
        drop(running);
        return Ok(outcome);
    }
    let answer = |claimer: Option<OwnedFd>, marks: &mut Marks| {
        marks.mark("end recorded, answering");
        marks.collect();
        // The caller woken by the answer runs at once, even on this CPU:
        // this monitor is in the idle class while it answers (a caller
        // woken by a monitor of its own class waits for the monitor's
        // time slice). Failing only makes the caller wait.
        let _ = set_scheduling(Scheduling::Idle);
        if let Some(c) = claimer {
            // A caller gone needs no answer.
            let _ = wire::send(
                c.as_fd(),
                &FromMonitor::Exited {
                    code: exit_code,
                    oom_killed,
                    marks: marks.take(),
                },
                &[],
            );
        }
        // What follows is cleanup nobody waits for: it yields to the caller
        // (and whatever it runs next) on a busy machine, but is not starved
        // there as the idle class could be.
        let _ = set_scheduling(Scheduling::Normal(10));
    };
    marks.mark("oom read");
    if rm {
        // Record and data renamed away before the answer (the name is free,
        // nothing of the box is listed); removed after it, with the cgroup
        // and the address (`gc` meanwhile leaves them to this monitor: see
        // `Registry::bury`).
        let tombs = reg.bury(record)?;
        answer(claimer, &mut marks);
        release(record);
        drop(running);
        return reg.remove_buried(&tombs).map(|()| outcome);
    }
    let stats = cgroup.as_ref().and_then(|c| match c.stats() {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(box_name = name, "reading the final stats: {e}");
            None
        }
    });
    let recorded = crate::monitor::record_exited(reg, record, exit_code, oom_killed, stats);
    answer(claimer, &mut marks);
    release(record);
    drop(running);
    recorded.map(|_| outcome)
}
