//! The monitor: the per-box supervising process, parent of the box's init.
//!
//! It prepares what the box owns (cgroup, writable layers), forks the box's first
//! process into new namespaces, lets it proceed once id maps and cgroup are in
//! place, relays the command's output to the log (and, in the foreground, to the
//! caller), forwards signals it receives to the box, and when init exits records
//! the exit status, the OOM verdict and the final resource figures, then removes
//! the cgroup. In the foreground the `nestbox run` process is the monitor; with
//! `--detach` it is a forked child in its own session.
//!
//! If anything fails before the command runs, everything made so far is removed
//! again (cgroup, layers, record) and the error is returned.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::time::{Duration, Instant};

use nestbox_cgroup::{BoxCgroup, Hierarchies};
use nestbox_isolation::idmap::IdMap;
use nestbox_isolation::namespaces::{fork_into, Forked, BOX_NAMESPACES};
use nestbox_isolation::rootfs::{LayerMount, RootfsPlan};
use nix::fcntl::OFlag;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sched::CloneFlags;
use nix::sys::signal::{kill, sigprocmask, SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::waitpid;
use nix::unistd::{pipe2, Pid};

use crate::launch::{box_first_process, read_report, ChildFds, CommandPlan, LaunchPlan};
use crate::liveness::ProcRef;
use crate::logs::{LogWriter, Stream};
use crate::registry::{BoxRecord, Registry};
use crate::spec::{BoxSpec, NetworkMode, SeccompChoice};
use crate::state::{now, Status};
use crate::{Result, RuntimeError};

/// Signals the monitor passes on to the box.
pub const FORWARDED: &[Signal] = &[
    Signal::SIGINT,
    Signal::SIGTERM,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
];

/// How the monitor talks to whoever started the box.
#[derive(Debug)]
pub enum Mode {
    /// The caller waits: output goes to its stdout/stderr as well as the log.
    Foreground,
    /// The caller left: report "started" or the start error on this pipe, then go on alone.
    Detached(OwnedFd),
    /// A pooled box shell (see [`crate::lifecycle::shell`]): report "ok" on
    /// this pipe once the shell is ready, then wait to be claimed.
    Shell(OwnedFd),
}

/// How a box ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// Exit code of the command (128+N if killed by signal N).
    pub exit_code: i32,
    /// Killed by the kernel's OOM killer at the box's memory limit.
    pub oom_killed: bool,
}

/// A started box, as the monitor holds it.
pub(crate) struct Running {
    pub(crate) init: Pid,
    pub(crate) pidfd: OwnedFd,
    pub(crate) stdout: File,
    pub(crate) stderr: File,
    /// Where init says the box has ended, just before its own exit (see
    /// [`crate::init`]): its exit code, once every other process of the box
    /// is gone. The monitor answers on it rather than waiting for init's
    /// exit, and reaps init before it releases the box ([`Running::reap`]).
    pub(crate) ended: File,
    /// Whether init was reaped.
    pub(crate) reaped: std::cell::Cell<bool>,
    pub(crate) cgroup: Option<BoxCgroup>,
    /// The box's mount namespace, held open so that tearing it down (and
    /// freeing the writable layer's directories) happens after the box is
    /// gone, off the foreground caller's path: see
    /// [`crate::process::release_in_background`].
    pub(crate) mount_ns: Option<OwnedFd>,
    /// A pooled shell: the monitor's end of the channel to its init.
    pub(crate) shell: Option<OwnedFd>,
}

/// Start the box of `record` and supervise it until it ends.
///
/// The monitor does not write the child's pid into the cgroup: the child moves
/// itself (see `LaunchPlan::cgroup_join`) before it does anything else.
pub fn run_box(reg: &Registry, record: &BoxRecord, mode: Mode) -> Result<Outcome> {
    run_box_as(reg, record, mode, false)
}

/// [`run_box`] for a box that ran before (restarted after a rollback): a
/// failure to start leaves its record, marked exited with the error, instead
/// of removing it (its layer and snapshots with it).
pub fn rerun_box(reg: &Registry, record: &BoxRecord, mode: Mode) -> Result<Outcome> {
    run_box_as(reg, record, mode, true)
}

fn run_box_as(reg: &Registry, record: &BoxRecord, mode: Mode, again: bool) -> Result<Outcome> {
    if !matches!(mode, Mode::Foreground) {
        crate::residency::one_malloc_arena();
        crate::diag::to_file(record.monitor_log_path(), false);
    }
    let signals = block_forwarded_signals()?;
    if let Mode::Shell(ready) = mode {
        return crate::lifecycle::shell::serve::run(reg, record, ready, signals);
    }
    let started = start(reg, record, matches!(mode, Mode::Foreground), again, false);
    let ready = match mode {
        Mode::Foreground | Mode::Shell(_) => None,
        Mode::Detached(fd) => Some(File::from(fd)),
    };
    let running = match started {
        Ok(r) => r,
        Err(e) => {
            if let Some(mut ready) = ready {
                // A caller that left cannot be told; the error is returned
                // (and logged) all the same.
                let _ = write!(ready, "{}\t{}", e.exit_code(), e);
            }
            return Err(e);
        }
    };
    let foreground = ready.is_none();
    if let Some(mut ready) = ready {
        // A caller that left (EPIPE) needs no answer: the box runs anyway.
        let _ = ready.write_all(b"ok");
    }
    // A detached monitor renews its image once the box is idle.
    supervise_then_finish(reg, record, running, signals, foreground, !foreground)
}

/// Supervise the started box of `record` until it ends ([`supervise`]), then
/// record its end and release it ([`finish`]). With `renew`, the monitor
/// replaces its image once the box is idle ([`crate::lifecycle::lean`]); the
/// new image goes on here, without.
pub(crate) fn supervise_then_finish(
    reg: &Registry,
    record: &BoxRecord,
    running: Running,
    signals: SignalFd,
    foreground: bool,
    renew: bool,
) -> Result<Outcome> {
    let become_lean = || crate::lifecycle::lean::become_lean_monitor(reg, record, &running);
    let renew = renew.then_some(&become_lean as &dyn Fn());
    let (exit_code, _, _) = supervise(record, &running, signals, foreground, None, None, renew);
    crate::phases::mark("monitor: output drained, exit code read");
    finish(reg, record, running, exit_code)
}

/// Prepare and start; on failure remove everything made for the box. With
/// `shell`, the box is a pooled shell: its init waits for a command.
pub(crate) fn start(
    reg: &Registry,
    record: &BoxRecord,
    hold_mount_ns: bool,
    again: bool,
    shell: bool,
) -> Result<Running> {
    let mut cgroup = None;
    let result = start_inner(reg, record, &mut cgroup, hold_mount_ns, shell);
    if result.is_err() {
        // The start's error is the one returned; what its cleanup could not
        // undo is logged, and `gc` finds it by its id later.
        let name = Some(record.name());
        if let Some(cg) = &cgroup {
            crate::diag::warn_on_err(name, "killing the box's processes", cg.kill_all());
            crate::diag::warn_on_err(name, "removing the cgroup", cg.remove());
        }
        let released = crate::network::release(reg.roots(), &record.state.id);
        crate::diag::warn_on_err(name, "releasing the network", released);
        if again {
            let msg = result.as_ref().err().map(|e| e.to_string());
            let marked = reg.update(record.name(), |s| {
                s.status = Status::Exited;
                s.exit_code = Some(crate::error::EXIT_NESTBOX_ERROR);
                s.finished_at = Some(now());
                s.cgroup = None;
                s.error = msg;
            });
            crate::diag::warn_on_err(name, "recording the failed restart", marked);
        } else {
            crate::diag::warn_on_err(name, "removing the record", reg.remove(record));
        }
    }
    result
}

fn start_inner(
    reg: &Registry,
    record: &BoxRecord,
    cgroup_slot: &mut Option<BoxCgroup>,
    hold_mount_ns: bool,
    shell: bool,
) -> Result<Running> {
    let spec = &record.spec;
    // A shell is named on its network only once claimed, by its box's names.
    let host_names = if shell { Vec::new() } else { spec.host_names() };
    let template = match &spec.clone_of {
        Some(src) => Some(crate::lifecycle::nested::load_template(
            reg,
            &src.template_box,
        )?),
        None => None,
    };
    let (idmap, owner, cookie) = match &template {
        Some(t) => crate::lifecycle::nested::shell_identity(t)?,
        None => {
            let idmap = spec.userns.then(IdMap::for_caller);
            (
                idmap,
                idmap.map(|m| m.host_root()),
                Some(new_setns_cookie()?),
            )
        }
    };
    // As root, a box of its own (no template, no user namespace) gets its
    // cgroup made while its first process, already forked, assembles its
    // root: the two take about the same time and this machine has more than
    // one CPU. The process joins the cgroup after the go, before anything of
    // the command runs. Otherwise (a cgroup that may fail to be made without
    // root; a clone or user-namespace box that waits for the go before its
    // mounts) the cgroup is made first.
    let cgroup_id = reg.roots().cgroup_id(&record.state.id);
    let overlap = template.is_none() && idmap.is_none() && nix::unistd::geteuid().is_root();
    let (mut cgroup, pending_cgroup) = if overlap {
        let h = Hierarchies::detect()?;
        (
            None,
            Some(BoxCgroup::prepare(&h, &cgroup_id, &spec.limits)?),
        )
    } else {
        (create_cgroup(spec, &cgroup_id, owner)?, None)
    };
    *cgroup_slot = cgroup.clone();
    crate::phases::mark("monitor: cgroup planned");
    // A clone shell of a template with a user namespace, started by nestbox
    // inside a box (root of the box's user namespace only): cgroup v1 lets it
    // move only processes of its own uid into the shell's cgroup, by the
    // credentials a `tasks` file was opened with. The shell's first process
    // and the clone's process are the template's root's: the shell's `tasks`
    // files become that uid's, and are opened as it (here, and by the clone).
    let join_as = match (&template, owner) {
        (Some(t), Some(owner))
            if t.state.idmap.is_some() && nestbox_isolation::idmap::in_user_namespace() =>
        {
            if let Some(cg) = &cgroup {
                cg.give_tasks_files_to(owner)?;
            }
            Some(owner.0)
        }
        _ => None,
    };
    // The cgroup is recorded with the Running state below; until then a crash
    // leaves it to `gc`, which finds it by this root's tag in its name.
    // A namespace from the pool when the box may have one. The pool being
    // empty or busy is no error, nor is a broken entry (claim removes it): the
    // box then makes its own namespace.
    // A box started again takes back the address it had when it is free
    // (its peers, and processes a rollback puts back, know it): not one
    // from the pool then.
    let previous = record
        .state
        .network
        .as_ref()
        .and_then(|n| n.get("address")?.as_str()?.parse().ok());
    let pooled = if previous.is_none() && crate::network_pool::eligible(spec) {
        crate::network_pool::claim(reg.roots(), &record.state.id, &host_names).unwrap_or(None)
    } else {
        None
    };
    let net = match pooled {
        Some(_) => None,
        None => crate::network::Pending::lease(
            reg.roots(),
            &record.state.id,
            spec,
            &host_names,
            previous,
        )?,
    };
    crate::phases::mark("monitor: network leased or claimed");
    let net_volumes = match (&pooled, &net) {
        (Some(_), _) => crate::network::view(reg.roots())?
            .map(|n| crate::network::volumes(&n))
            .unwrap_or_default(),
        (None, Some(n)) => n.volumes(),
        (None, None) => Vec::new(),
    };
    // A box for boxes (`--nest`): its state directory and the nestbox
    // binary bound in, its delegated cgroups mounted.
    let mut volumes = net_volumes;
    let nest = match (spec.nest, &cgroup) {
        (true, Some(cg)) => {
            volumes.extend(crate::lifecycle::nest::volumes(
                record,
                template.as_ref(),
                owner,
            )?);
            Some(crate::lifecycle::nest::mounts(cg))
        }
        _ => None,
    };
    let mut plan = launch_plan(
        reg,
        record,
        idmap,
        owner,
        cookie,
        template.as_ref(),
        volumes,
    )?;
    crate::phases::mark("monitor: launch plan built");
    plan.rootfs.nest = nest;
    let join_files = match (&cgroup, &pending_cgroup) {
        (Some(c), _) => c.ns_root_join_files(),
        (None, Some(p)) => p.self_join_files(),
        (None, None) => Vec::new(),
    };
    plan.cgroup_leaf = cgroup
        .as_ref()
        .map(|c| c.leaf_join_files())
        .unwrap_or_default();
    plan.assemble_before_go = overlap;
    plan.shell = shell;
    let (shell_ours, shell_theirs) = if shell {
        let (a, b) = crate::lifecycle::shell::wire::pair()
            .map_err(|e| RuntimeError::Failed(format!("socketpair for the shell: {e}")))?;
        (Some(a), Some(b))
    } else {
        (None, None)
    };
    // A clone of a template with a user namespace starts as that namespace's root,
    // which may not write the host's cgroup files: the monitor moves it instead
    // (into `tasks`, the cheap path, as it is single-threaded).
    let monitor_joins = template.as_ref().is_some_and(|t| t.state.idmap.is_some());
    if !monitor_joins {
        plan.cgroup_join = join_files.clone();
    }

    // Monitors (`--monitor`): made now, so that a socket monitor not
    // listening or a trace log that cannot be written fails the start.
    // The packet inspector (`packets:`) subscribes to no call: it is set up
    // with the box's network below.
    let (packets, call_monitors) = nestbox_interpose::split_packets(&spec.monitors);
    let packets = match &packets {
        Some(p) => Some((
            p.clone(),
            nestbox_interpose::packets::Inspector::open(p, &trace_log(record))
                .map_err(|e| RuntimeError::InvalidInput(e.to_string()))?,
        )),
        None => None,
    };
    let interpose = match plan.command.as_mut() {
        Some(command) if !call_monitors.is_empty() => {
            let stack = nestbox_interpose::Stack::open(&call_monitors, &trace_log(record))
                .map_err(|e| RuntimeError::InvalidInput(e.to_string()))?;
            let cookie = new_setns_cookie()?;
            let specs: Vec<nestbox_interpose::MonitorSpec> = call_monitors
                .iter()
                .map(|m| nestbox_interpose::MonitorSpec::parse(m))
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| RuntimeError::InvalidInput(e.to_string()))?;
            let filter =
                nestbox_seccomp::monitor_profile(&nestbox_interpose::subscribed(&specs), cookie)
                    .compile()?;
            command.monitor_filter = Some((filter, cookie));
            let (ours, theirs) = nix::sys::socket::socketpair(
                nix::sys::socket::AddressFamily::Unix,
                nix::sys::socket::SockType::SeqPacket,
                None,
                nix::sys::socket::SockFlag::SOCK_CLOEXEC,
            )
            .map_err(RuntimeError::sys("socketpair"))?;
            Some((stack, ours, theirs))
        }
        _ => None,
    };
    let (interpose, interpose_child) = match interpose {
        Some((stack, ours, theirs)) => (Some((stack, ours)), Some(theirs)),
        None => (None, None),
    };
    let (go_r, go_w) = pipe2(OFlag::O_CLOEXEC).map_err(RuntimeError::sys("pipe2"))?;
    let (rep_r, rep_w) = pipe2(OFlag::O_CLOEXEC).map_err(RuntimeError::sys("pipe2"))?;
    let (out_r, out_w) = pipe2(OFlag::O_CLOEXEC).map_err(RuntimeError::sys("pipe2"))?;
    let (err_r, err_w) = pipe2(OFlag::O_CLOEXEC).map_err(RuntimeError::sys("pipe2"))?;
    let (end_r, end_w) = pipe2(OFlag::O_CLOEXEC).map_err(RuntimeError::sys("pipe2"))?;
    let stdin: OwnedFd = if spec.interactive {
        nix::unistd::dup(0)
            .map(|fd| {
                // SAFETY: dup returned a fresh descriptor that nothing else owns.
                unsafe { OwnedFd::from_raw_fd(fd) }
            })
            .map_err(RuntimeError::sys("dup stdin"))?
    } else {
        File::open("/dev/null")
            .map_err(RuntimeError::io("open", "/dev/null"))?
            .into()
    };

    crate::phases::mark("monitor: pipes opened, forking");
    let mut flags = BOX_NAMESPACES;
    if spec.network.mode == NetworkMode::Host {
        flags.remove(CloneFlags::CLONE_NEWNET);
    }
    if idmap.is_some() {
        flags |= CloneFlags::CLONE_NEWUSER;
    }
    // With a pooled namespace the box's first process is forked inside it
    // rather than into a new one.
    let host_netns = match &pooled {
        Some(p) => {
            flags.remove(CloneFlags::CLONE_NEWNET);
            Some(crate::network_pool::enter(&p.netns)?)
        }
        None => None,
    };
    let forked = match &template {
        // A clone's pid namespace must be nested in its template's: that is the
        // only place a process forked from the template can be moved into.
        Some(t) => fork_nested_in(t, flags, idmap),
        // SAFETY: the monitor is single-threaded, so the child may run arbitrary
        // code; the flags are CLONE_NEW* only.
        None => unsafe { fork_into(flags) }
            .map(|f| (f, false))
            .map_err(RuntimeError::from),
    };
    if let Some(own) = host_netns {
        if matches!(forked, Ok((Forked::Child, _))) {
            // The box's first process lives in the pooled namespace.
            own.stay();
        } else {
            let back = crate::network_pool::leave(own);
            if let (Ok((Forked::Parent(pid), _)), Err(_)) = (&forked, &back) {
                // Our own child, just forked: the kill and the wait cannot fail
                // but for a child already dead (ESRCH) or reaped.
                let _ = kill(pid.to_owned(), Signal::SIGKILL);
                let _ = waitpid(pid.to_owned(), None);
            }
            back?;
        }
    }
    let (forked, maps_written) = forked?;
    let child = match forked {
        Forked::Child => {
            drop((go_w, rep_r, out_r, err_r, end_r));
            let fds = ChildFds {
                stdin,
                stdout: out_w,
                stderr: err_w,
                go: go_r,
                report: rep_w,
                interpose: interpose_child,
                shell: shell_theirs,
                ended: end_w,
            };
            box_first_process(&plan, fds)
        }
        Forked::Parent(pid) => pid,
    };
    crate::phases::mark("monitor: forked");
    drop((
        go_r,
        rep_w,
        out_w,
        err_w,
        end_w,
        stdin,
        interpose_child,
        shell_theirs,
    ));
    let abandon = |e: RuntimeError| {
        // As above: our own child; ESRCH only if it died already.
        let _ = kill(child, Signal::SIGKILL);
        let _ = waitpid(child, None);
        // A box process that failed on its own (assembling its root before
        // the go) said why on the report pipe: that is the error to give.
        match read_report(&rep_r) {
            Some((code, message)) => RuntimeError::Launch { code, message },
            None => e,
        }
    };
    if let Some(pending) = pending_cgroup {
        let made = pending.create().map_err(|e| abandon(e.into()))?;
        *cgroup_slot = Some(made.clone());
        cgroup = Some(made);
        crate::phases::mark("monitor: cgroup made");
    }
    if let (Some(map), false) = (idmap, maps_written) {
        map.apply(child).map_err(|e| abandon(e.into()))?;
    }
    if monitor_joins {
        for file in &join_files {
            move_into_cgroup(file, child, join_as).map_err(abandon)?;
        }
    }
    let network = match (&pooled, &net) {
        (Some(p), _) => Some(p.attachment.clone()),
        (None, Some(n)) => Some(n.attach(child, spec).map_err(abandon)?),
        (None, None) => None,
    };
    crate::phases::mark("monitor: network attached");
    if let Some((p, inspector)) = packets {
        crate::network::packets::start(child, &p, inspector).map_err(abandon)?;
        crate::phases::mark("monitor: packet inspector bound");
    }
    let pidfd = crate::process::pidfd_open(child.as_raw()).map_err(abandon)?;
    // Holding it is an optimisation only: if it cannot be opened, init's exit
    // tears the namespace down as it would anyway.
    let mount_ns = hold_mount_ns
        .then(|| File::open(format!("/proc/{child}/ns/mnt")).ok())
        .flatten()
        .map(OwnedFd::from);
    nix::unistd::write(&go_w, b"g").map_err(|e| {
        abandon(match &template {
            // A clone shell's first process lives in its template's pid
            // namespace: the kernel killed it when the template's init ended
            // (the template was removed meanwhile).
            Some(t)
                if t.state
                    .init
                    .is_some_and(|i| i.ends_within(Duration::from_secs(1))) =>
            {
                RuntimeError::TemplateRemoved(t.template_name().to_string())
            }
            _ => RuntimeError::sys("start box")(e),
        })
    })?;
    drop(go_w);
    crate::phases::mark("monitor: go sent");
    if let Some((stack, sock)) = interpose {
        // The command sends the listener before it execs (end of file: it
        // failed before; its report says why). From then on its subscribed
        // calls wait for the thread started here.
        match nestbox_sys::seccomp_notify::receive_listener(sock.as_fd()) {
            Ok(Some(listener)) => {
                std::thread::Builder::new()
                    .name("monitors".into())
                    .spawn(move || nestbox_interpose::serve(listener, stack))
                    .map_err(|e| {
                        abandon(RuntimeError::Failed(format!(
                            "no thread for the monitors: {e}"
                        )))
                    })?;
            }
            Ok(None) => {}
            Err(e) => {
                return Err(abandon(
                    RuntimeError::sys("receive the monitors' listener")(e),
                ))
            }
        }
    }
    if let Some((code, message)) = read_report(&rep_r) {
        // The box's process reported its failure and exits: reap it (it is
        // our child, so only EINTR could fail, leaving a zombie until we exit).
        let _ = waitpid(child, None);
        return Err(RuntimeError::Launch { code, message });
    }
    crate::phases::mark("monitor: command exec'd (report closed)");
    let init = ProcRef::of(child.as_raw());
    reg.update(record.name(), |s| {
        s.status = Status::Running;
        s.init = init;
        s.started_at = Some(now());
        s.cgroup = cgroup.clone();
        s.idmap = idmap;
        s.monitor = Some(ProcRef::current());
        s.setns_cookie = cookie;
        s.network = network.clone();
    })
    .map_err(abandon)?;
    crate::phases::mark("monitor: state running");
    if crate::network_pool::eligible(spec) {
        crate::network_pool::spawn_fill(reg.roots());
    }
    Ok(Running {
        init: child,
        pidfd,
        stdout: File::from(out_r),
        stderr: File::from(err_r),
        ended: File::from(end_r),
        reaped: std::cell::Cell::new(false),
        cgroup,
        mount_ns,
        shell: shell_ours,
    })
}

/// Write `pid` into the cgroup membership file `file`: a v1 `tasks` file
/// opened as uid `opener` if given (see where `join_as` is set).
fn move_into_cgroup(file: &std::path::Path, pid: Pid, opener: Option<u32>) -> Result<()> {
    let text = pid.as_raw().to_string();
    match opener {
        Some(uid) if file.file_name().is_some_and(|n| n == "tasks") => {
            let fd = nestbox_sys::creds::open_for_writing_as(file, uid).map_err(
                RuntimeError::sys(format!("open {} as uid {uid}", file.display())),
            )?;
            File::from(fd)
                .write_all(text.as_bytes())
                .map_err(RuntimeError::io("write", file))
        }
        _ => std::fs::write(file, text).map_err(RuntimeError::io("write", file)),
    }
}

/// Fork the box's first process into new namespaces (`flags`) with its pid
/// namespace nested in template `t`'s. The kernel creates a new pid namespace only
/// under the creator's own, so a helper is forked into the template's pid
/// namespace first; it creates the box process as the monitor's child
/// (`CLONE_PARENT`) and leaves. The new child is then the monitor's only child.
///
/// When the template itself runs in a user namespace (a clone: clones of clones),
/// the helper joins it first, as its root, so the clone's user namespace is a
/// child of the template's owned by the template's root, and writes the new
/// namespace's id maps itself (only a process in the parent namespace may); the
/// second value says so. A monitor in a user namespace of its own (nestbox in a
/// box) cannot enter the template's pid namespace itself: see
/// [`fork_nested_from_a_box`].
fn fork_nested_in(
    t: &BoxRecord,
    flags: CloneFlags,
    idmap: Option<IdMap>,
) -> Result<(Forked, bool)> {
    let template_userns = match (t.state.idmap, t.state.init) {
        (Some(_), Some(init)) => {
            let path = format!("/proc/{}/ns/user", init.pid);
            Some(std::fs::File::open(&path).map_err(RuntimeError::io("open", &path))?)
        }
        _ => None,
    };
    crate::lifecycle::nested::refuse_too_deep(t)?;
    match template_userns {
        Some(userns) if nestbox_isolation::idmap::in_user_namespace() => {
            fork_nested_from_a_box(t, userns, flags, idmap)
        }
        userns => fork_nested_on_the_host(t, userns, flags, idmap),
    }
}

/// [`fork_nested_in`] by a monitor that holds `CAP_SYS_ADMIN` in its user
/// namespace (the host's root): it enters the template's pid namespace itself
/// for the fork of the helper, and returns to its own at once.
fn fork_nested_on_the_host(
    t: &BoxRecord,
    template_userns: Option<std::fs::File>,
    flags: CloneFlags,
    idmap: Option<IdMap>,
) -> Result<(Forked, bool)> {
    let in_template = crate::lifecycle::nested::enter_pid_namespace_of(t)?;
    // SAFETY: the monitor is single-threaded, so the helper may run arbitrary
    // code; no clone flags.
    let forked = unsafe { fork_into(CloneFlags::empty()) }.map_err(|e| template_ended(t, e.into()));
    if let Ok(Forked::Child) = &forked {
        // The helper is in the template's pid namespace and stays there.
        in_template.stay();
    } else {
        // Children (threads too) of the monitor are born in its own pid namespace
        // again: a thread cannot be created while the two differ.
        in_template
            .leave()
            .map_err(RuntimeError::sys("setns(own pid namespace)"))?;
    }
    let maps_written = template_userns.is_some();
    match forked? {
        Forked::Child => match nested_helper(template_userns, flags, idmap) {
            Ok(Forked::Child) => Ok((Forked::Child, maps_written)),
            Ok(Forked::Parent(_)) => nestbox_sys::process::exit_now(0),
            Err(_) => nestbox_sys::process::exit_now(crate::error::EXIT_NESTBOX_ERROR),
        },
        Forked::Parent(helper) => {
            if crate::process::wait_exit_code(helper) != 0 {
                return Err(no_namespaces_under(t));
            }
            Ok((Forked::Parent(newest_child()?), maps_written))
        }
    }
}

/// [`fork_nested_in`] by a monitor in a user namespace of its own, without
/// `CAP_SYS_ADMIN` there (nestbox inside a `--nest` box, as the box's root):
/// `setns` into the template's pid namespace needs that capability in the
/// caller's user namespace as well as in the namespace's owner. So the first
/// helper, a plain child, joins the template's user namespace first (the
/// monitor's root owns it, so it gets every capability there, and a process
/// cannot come back from a user namespace: hence a helper), then its pid
/// namespace, and forks a second helper as the monitor's child
/// (`CLONE_PARENT`), born in the template's pid namespace. That one creates
/// the box process as the monitor's child too, writes its id maps and leaves.
/// The monitor itself never changes namespace. The first helper tells the
/// monitor the second's pid (on a pipe), so that it can wait for it.
fn fork_nested_from_a_box(
    t: &BoxRecord,
    template_userns: std::fs::File,
    flags: CloneFlags,
    idmap: Option<IdMap>,
) -> Result<(Forked, bool)> {
    let (pid_ns, _) = crate::lifecycle::nested::open_pid_namespace_of(t)?;
    let (report_r, report_w) = pipe2(OFlag::O_CLOEXEC).map_err(RuntimeError::sys("pipe2"))?;
    // SAFETY: the monitor is single-threaded, so the helper may run arbitrary
    // code; no clone flags.
    let forked = unsafe { fork_into(CloneFlags::empty()) }.map_err(RuntimeError::from)?;
    let first = match forked {
        Forked::Child => {
            drop(report_r);
            return match first_helper_in_a_box(&template_userns, &pid_ns, report_w, flags, idmap) {
                // The box's first process: its maps are written.
                Ok(Forked::Child) => Ok((Forked::Child, true)),
                Ok(Forked::Parent(_)) => nestbox_sys::process::exit_now(0),
                Err(_) => nestbox_sys::process::exit_now(crate::error::EXIT_NESTBOX_ERROR),
            };
        }
        Forked::Parent(pid) => pid,
    };
    drop(report_w);
    let first_ok = crate::process::wait_exit_code(first) == 0;
    let mut word = [0u8; 4];
    let second = (&File::from(report_r))
        .read_exact(&mut word)
        .ok()
        .map(|()| Pid::from_raw(i32::from_ne_bytes(word)));
    match second.filter(|p| p.as_raw() > 0) {
        // It made the box process and wrote its id maps (reaped in any case).
        Some(second) if crate::process::wait_exit_code(second) == 0 && first_ok => {
            Ok((Forked::Parent(newest_child()?), true))
        }
        Some(_) => Err(no_namespaces_under(t)),
        // No second helper: the first could not join the template's
        // namespaces or fork there (a pid namespace whose init is exiting,
        // the template being removed, takes no new process).
        None => Err(template_ended(t, no_namespaces_under(t))),
    }
}

/// The first helper of [`fork_nested_from_a_box`], a child of the monitor.
/// Returns `Forked::Child` in the box's first process, `Forked::Parent` in
/// the helpers (which then exit).
fn first_helper_in_a_box(
    template_userns: &std::fs::File,
    pid_ns: &std::fs::File,
    report: OwnedFd,
    flags: CloneFlags,
    idmap: Option<IdMap>,
) -> Result<Forked> {
    become_template_root(template_userns)?;
    nestbox_sys::ns::enter(pid_ns.as_fd(), nestbox_sys::ns::Namespace::Pid)
        .map_err(RuntimeError::sys("setns(template pid namespace)"))?;
    // SAFETY: this helper is a fork of the single-threaded monitor; the flag is
    // CLONE_PARENT only (the second helper is the monitor's child).
    match unsafe { fork_into(CloneFlags::CLONE_PARENT) }? {
        Forked::Parent(second) => {
            // Its pid as the monitor sees it: this helper's own pid namespace
            // is the monitor's. A pipe of 4 bytes is written whole.
            nix::unistd::write(&report, &second.as_raw().to_ne_bytes())
                .map_err(RuntimeError::sys("write the helper's pid"))?;
            Ok(Forked::Parent(second))
        }
        Forked::Child => {
            drop(report);
            fork_box_as_template_root(flags, idmap)
        }
    }
}

/// The helper of [`fork_nested_on_the_host`], already in the template's pid namespace.
fn nested_helper(
    template_userns: Option<std::fs::File>,
    flags: CloneFlags,
    idmap: Option<IdMap>,
) -> Result<Forked> {
    let Some(userns) = template_userns else {
        // SAFETY: this helper is a fork of the single-threaded monitor; the flags
        // are CLONE_NEW* and CLONE_PARENT only.
        return Ok(unsafe { fork_into(flags | CloneFlags::CLONE_PARENT) }?);
    };
    become_template_root(&userns)?;
    fork_box_as_template_root(flags, idmap)
}

/// Join the template's user namespace `userns` for good, as its root.
fn become_template_root(userns: &std::fs::File) -> Result<()> {
    nestbox_sys::ns::enter(userns.as_fd(), nestbox_sys::ns::Namespace::User)
        .map_err(RuntimeError::sys("setns(template user namespace)"))?;
    let root_gid = nix::unistd::Gid::from_raw(0);
    let root_uid = nix::unistd::Uid::from_raw(0);
    nix::unistd::setresgid(root_gid, root_gid, root_gid)
        .map_err(RuntimeError::sys("setresgid(0)"))?;
    nix::unistd::setresuid(root_uid, root_uid, root_uid)
        .map_err(RuntimeError::sys("setresuid(0)"))?;
    // Changing uids made this process (and so its child) non-dumpable, which
    // would leave the child's /proc files, uid_map included, to host root.
    nix::sys::prctl::set_dumpable(true).map_err(RuntimeError::sys("prctl(PR_SET_DUMPABLE)"))
}

/// Fork the box's first process as the monitor's child (`CLONE_PARENT`), from a
/// helper in the template's pid and user namespaces, and write its id maps.
fn fork_box_as_template_root(flags: CloneFlags, idmap: Option<IdMap>) -> Result<Forked> {
    // SAFETY: the caller is a single-threaded helper forked from the monitor;
    // the flags are CLONE_NEW* and CLONE_PARENT only.
    let (forked, pidfd) = unsafe {
        nestbox_isolation::namespaces::fork_into_with_pidfd(flags | CloneFlags::CLONE_PARENT)
    }?;
    if let (Forked::Parent(_), Some(pidfd), Some(map)) = (&forked, pidfd, idmap) {
        // The pid clone returned is the one in the template's namespace; /proc
        // here is the monitor's, so take the pid there from the pidfd.
        let pid = crate::process::pid_of_pidfd(&pidfd)?;
        map.apply(Pid::from_raw(pid))?;
    }
    Ok(forked)
}

/// The monitor's newest child: the box process its helpers made.
fn newest_child() -> Result<Pid> {
    let me = nix::unistd::getpid();
    let path = format!("/proc/{me}/task/{me}/children");
    let text = std::fs::read_to_string(&path).map_err(RuntimeError::io("read", &path))?;
    text.split_whitespace()
        .filter_map(|p| p.parse::<i32>().ok())
        .next_back()
        .map(Pid::from_raw)
        .ok_or_else(|| RuntimeError::Failed("the clone's first process vanished".into()))
}

fn no_namespaces_under(t: &BoxRecord) -> RuntimeError {
    RuntimeError::Failed(format!(
        "could not create the clone's namespaces under template {:?}",
        t.name()
    ))
}

/// `e`, or that the template went if its init is exiting (the template was
/// removed, or stopped): its pid namespace takes no new process (`ENOMEM`).
fn template_ended(t: &BoxRecord, e: RuntimeError) -> RuntimeError {
    match t.state.init {
        Some(init) if init.ends_within(std::time::Duration::from_secs(5)) => {
            RuntimeError::TemplateRemoved(t.template_name().to_string())
        }
        _ => e,
    }
}

/// Create the box cgroup. Without root, a box with no limits may run without one.
/// A box for boxes (`--nest`) gets its cgroup delegated to `owner`, its root.
fn create_cgroup(spec: &BoxSpec, id: &str, owner: Option<(u32, u32)>) -> Result<Option<BoxCgroup>> {
    if spec.nest {
        let owner = owner.ok_or_else(|| {
            RuntimeError::InvalidInput("--nest needs a user namespace (--userns)".into())
        })?;
        let made = Hierarchies::detect()
            .and_then(|h| BoxCgroup::prepare_delegated(&h, id, &spec.limits, owner)?.create());
        return match made {
            Ok(cg) => Ok(Some(cg)),
            Err(e) if !nix::unistd::geteuid().is_root() => Err(RuntimeError::InvalidInput(format!(
                "--nest needs a cgroup this user can write and delegate (run as root or in a delegated cgroup): {e}"
            ))),
            Err(e) => Err(e.into()),
        };
    }
    let wants_limits = spec.limits != nestbox_cgroup::Limits::default();
    let attempt = Hierarchies::detect().and_then(|h| BoxCgroup::create(&h, id, &spec.limits));
    match attempt {
        Ok(cg) => Ok(Some(cg)),
        // Without root, a box with no limits runs without a cgroup of its own
        // (documented): the reason there is none is no news.
        Err(_) if !nix::unistd::geteuid().is_root() && !wants_limits => Ok(None),
        Err(e) if !nix::unistd::geteuid().is_root() => Err(RuntimeError::InvalidInput(format!(
            "resource limits need a cgroup this user can write (run as root or in a delegated cgroup): {e}"
        ))),
        Err(e) => Err(e.into()),
    }
}

/// Build the launch plan: root view, writable layers, command.
/// `owner` is the host (uid, gid) the box's root maps to; a clone's root view is
/// its template's, with the template's (frozen) writable layers as extra lowers.
fn launch_plan(
    reg: &Registry,
    record: &BoxRecord,
    idmap: Option<IdMap>,
    owner: Option<(u32, u32)>,
    cookie: Option<[u64; 2]>,
    template: Option<&BoxRecord>,
    net_volumes: Vec<nestbox_isolation::rootfs::Volume>,
) -> Result<LaunchPlan> {
    let spec = &record.spec;
    let image = nestbox_image::open_image(&spec.image, &reg.roots().images())?;
    let mut view = image.root_view(owner)?;
    crate::phases::mark("monitor: image root view");
    // A restored box's root (and its clones'): the checkpoint's copies of
    // its layers, read-only, over those of the checkpoints it was made on
    // (`lowers`, top first).
    if let Some(dir) = &spec.restore_of {
        let chain = crate::paths::layer_chain(std::path::Path::new(dir));
        for (i, layer) in view.layers.iter_mut().enumerate() {
            for below in chain.iter().rev() {
                let saved = below.join(format!("layer-{i}"));
                if saved.is_dir() {
                    layer.lowers.insert(0, saved);
                }
            }
        }
    }
    if let Some(t) = template {
        // A template that is itself a clone (a clone frozen in turn) sees its
        // own template's layers below its own: so must its clones, the whole
        // chain, top first. (A template with clones is kept, removed or not,
        // until its last clone has gone, so each link is still recorded.)
        let mut chain = vec![t.clone()];
        let mut below = t.spec.clone_of.clone();
        while let Some(src) = below.take() {
            if chain.len() > 64 {
                break;
            }
            match reg.load(&src.template_box) {
                Ok(r) => {
                    below = r.spec.clone_of.clone();
                    chain.push(r);
                }
                Err(_) => break,
            }
        }
        for (i, layer) in view.layers.iter_mut().enumerate() {
            for rec in chain.iter().rev() {
                // A template rolled back to a snapshot before its freeze:
                // the snapshot's layer under its own.
                if let Some(tree) =
                    crate::snapshots::rollback_tree(rec.lib_dir()).filter(|_| i == 0)
                {
                    layer.lowers.insert(0, tree);
                }
                layer.lowers.insert(0, rec.layer_dirs(i).0);
            }
        }
    }
    if let Some(size) = spec.disk {
        crate::disk::ensure_mounted(record.lib_dir(), size, owner)?;
    }
    // A box rolled back to a snapshot: the snapshot's layer, read-only, right
    // under its (fresh) writable layer (see `snapshots`).
    // (A swap a crash interrupted is finished; the layers it replaced are
    // left for the rollback that made them, or the next snapshot operation,
    // to remove: not on the way to the box's start.)
    crate::snapshots::finish_swap(record.lib_dir(), &record.layer_dirs(0).0)?;
    if let (Some(tree), Some(layer)) = (
        crate::snapshots::rollback_tree(record.lib_dir()),
        view.layers.first_mut(),
    ) {
        layer.lowers.insert(0, tree);
    }
    let mut layers = Vec::new();
    for (i, layer) in view.layers.into_iter().enumerate() {
        let (upper, work) = record.layer_dirs(i);
        for d in [&upper, &work] {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(d)
                .map_err(RuntimeError::io("mkdir", d))?;
            if let Some((uid, gid)) = owner {
                nix::unistd::chown(d, Some(uid.into()), Some(gid.into()))
                    .map_err(RuntimeError::sys(format!("chown {}", d.display())))?;
            }
        }
        layers.push(LayerMount {
            target: layer.target,
            lowers: layer.lowers,
            upper,
            work,
        });
    }
    crate::phases::mark("monitor: layer dirs made");
    let mountpoint = reg.roots().root_mountpoint();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o711)
        .create(&mountpoint)
        .map_err(RuntimeError::io("mkdir", &mountpoint))?;
    let rootfs = RootfsPlan {
        mountpoint,
        layers,
        read_only_binds: view
            .read_only
            .into_iter()
            .map(|b| (b.source, b.target))
            .collect(),
        files: vec![("/etc/machine-id".into(), new_machine_id()?.into_bytes())],
        volumes: net_volumes
            .into_iter()
            .chain(spec.volumes.clone())
            .collect(),
        tmpfs: spec.tmpfs.clone(),
        read_only: spec.read_only,
        userns: idmap.is_some(),
        nest: None,
    };
    crate::phases::mark("monitor: machine id");
    let command = command_plan(spec, cookie, idmap)?;
    Ok(LaunchPlan {
        rootfs,
        hostname: spec.hostname.clone(),
        cgroup_join: Vec::new(),
        cgroup_leaf: Vec::new(),
        own_network: spec.network.mode != NetworkMode::Host,
        assemble_before_go: false,
        setgroups: idmap.is_none_or(|m| m.allows_setgroups()),
        // A clone shell's init waits for the process forked into it from the template.
        command: (template.is_none() && spec.restore_of.is_none()).then_some(command),
        shell: false,
    })
}

/// How the command of `spec` is started in its box (see
/// [`crate::launch::exec_command`]): by the box's first process, or by a
/// pooled shell's init once claimed.
pub(crate) fn command_plan(
    spec: &BoxSpec,
    cookie: Option<[u64; 2]>,
    idmap: Option<IdMap>,
) -> Result<CommandPlan> {
    let mut command = CommandPlan::new(
        &spec.command,
        spec.environment(),
        spec.workdir.clone(),
        spec.user,
        spec.capabilities.clone(),
        seccomp_program(spec, cookie)?,
        idmap.is_none_or(|m| m.allows_setgroups()),
        true,
    )?;
    command.memory_merge = spec.ksm;
    Ok(command)
}

/// A fresh /etc/machine-id for a box (bound read-only over the image's), so no
/// box sees the host's id and every clone gets a new one.
fn new_machine_id() -> Result<String> {
    let mut bytes = [0u8; 16];
    getrandom::getrandom(&mut bytes).map_err(|cause| RuntimeError::Random {
        what: "a machine id",
        cause,
    })?;
    let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("{id}\n"))
}

/// Compile the box's seccomp filter (None when unconfined). With a `cookie`, the
/// filter lets `setns` and `clone3` through when their (otherwise unused) third and
/// fourth arguments carry the cookie: the door nestbox's clone machinery uses to
/// steer a forked process into its clone's namespaces (and to give the clone its
/// template's pid there). The cookie never enters the box,
/// and the filter cannot be read from inside (that needs CAP_SYS_ADMIN on the host).
pub fn seccomp_program(
    spec: &BoxSpec,
    cookie: Option<[u64; 2]>,
) -> Result<Option<nestbox_seccomp::Program>> {
    let mut profile = match &spec.seccomp {
        SeccompChoice::Unconfined => return Ok(None),
        SeccompChoice::Default => nestbox_seccomp::default_profile(default_opts(spec)),
        SeccompChoice::Profile { text, .. } => nestbox_seccomp::Profile::from_docker_json(text)?,
    };
    if let Some([a, b]) = cookie {
        for call in [libc::SYS_setns, libc::SYS_clone3] {
            let door = nestbox_seccomp::Rule::new(call as u32, nestbox_seccomp::Action::Allow)
                .when(2, nestbox_seccomp::CmpOp::Eq, a)
                .when(3, nestbox_seccomp::CmpOp::Eq, b);
            profile.rules.insert(0, door);
        }
    }
    Ok(Some(profile.compile()?))
}

/// Where a box's `trace` monitors write.
pub fn trace_log(record: &BoxRecord) -> std::path::PathBuf {
    record.run_dir().join("trace.log")
}

/// A fresh random setns cookie.
pub fn new_setns_cookie() -> Result<[u64; 2]> {
    let mut bytes = [0u8; 16];
    getrandom::getrandom(&mut bytes).map_err(|cause| RuntimeError::Random {
        what: "the box's cookie",
        cause,
    })?;
    let (a, b) = bytes.split_at(8);
    let word = |s: &[u8]| u64::from_ne_bytes(s.try_into().unwrap_or([0; 8]));
    Ok([word(a), word(b)])
}

fn default_opts(spec: &BoxSpec) -> nestbox_seccomp::DefaultOpts {
    let mut opts = nestbox_seccomp::DefaultOpts::from_capability_names(spec.capabilities.iter());
    opts.nest = spec.nest;
    opts
}

pub(crate) fn block_forwarded_signals() -> Result<SignalFd> {
    let mut set = SigSet::empty();
    for s in FORWARDED {
        set.add(*s);
    }
    sigprocmask(SigmaskHow::SIG_BLOCK, Some(&set), None)
        .map_err(RuntimeError::sys("sigprocmask"))?;
    SignalFd::with_flags(&set, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(RuntimeError::sys("signalfd"))
}

/// Work a monitor does once the box has run for a while, or once it has
/// ended and its caller is answered, whichever comes first (a pooled shell's
/// refill: forking it right at the start would delay the box's command).
pub(crate) struct Later {
    /// When it is due.
    pub(crate) at: Instant,
    /// What to do.
    pub(crate) work: Box<dyn FnOnce()>,
}

/// Relay output and signals until the box ends: init says so on
/// [`Running::ended`] (every other process of the box gone; init exits
/// next: the caller reaps it with [`Running::reap`] before it releases the
/// box), or exits without saying it (it was killed). Returns the box's exit
/// code, and whether the `claimer` went away first, and `later` if it was
/// not due yet. `claimer`: the connection of the foreground `nestbox run`
/// that claimed a pooled shell, which sends the signals it gets; when it
/// closes (the caller was killed) the box is killed, as a cold box dies with
/// its foreground monitor. `renew`: called once the box has been idle for
/// [`crate::residency::IDLE_MS_BEFORE_DROP`] with no work left for later
/// (a detached monitor replaces its image there: see
/// [`crate::lifecycle::lean`]); if it returns, the monitor gives back its
/// idle memory and goes on.
pub(crate) fn supervise(
    record: &BoxRecord,
    run: &Running,
    signals: SignalFd,
    foreground: bool,
    claimer: Option<std::os::fd::BorrowedFd<'_>>,
    mut later: Option<Later>,
    renew: Option<&dyn Fn()>,
) -> (i32, bool, Option<Later>) {
    let mut claimer = claimer;
    let mut abandoned = false;
    let mut log = match LogWriter::open(&record.log_path()) {
        Ok(l) => Some(l),
        Err(e) => {
            tracing::error!(
                box_name = record.name(),
                "the box's output is not logged: {e}"
            );
            None
        }
    };
    let mut log_failed = false;
    let mut open = [true, true];
    let mut buf = vec![0u8; 64 * 1024];
    let mut dropped_file_pages = false;
    // Open until init said the box ended, or the pipe's end showed that init
    // is gone without saying it.
    let mut end_open = true;
    let mut said_ended: Option<i32> = None;
    let mut relay = |which: usize, file: &File, log: &mut Option<LogWriter>| -> bool {
        let stream = if which == 0 {
            Stream::Stdout
        } else {
            Stream::Stderr
        };
        match (&*file).read(&mut buf) {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                if let Some(l) = log.as_mut() {
                    if let Err(e) = l.append(stream, &buf[..n]) {
                        // Once: a full disk fails every write after.
                        if !std::mem::replace(&mut log_failed, true) {
                            tracing::error!(box_name = record.name(), "writing the box's log: {e}");
                        }
                    }
                }
                if foreground {
                    // A terminal that went away (EPIPE) cannot be written
                    // to; the log has the output.
                    let _ = if which == 0 {
                        std::io::stdout().write_all(&buf[..n])
                    } else {
                        std::io::stderr().write_all(&buf[..n])
                    };
                }
                true
            }
        }
    };
    loop {
        let mut fds = vec![
            PollFd::new(run.pidfd.as_fd(), PollFlags::POLLIN),
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
        ];
        if open[0] {
            fds.push(PollFd::new(run.stdout.as_fd(), PollFlags::POLLIN));
        }
        if open[1] {
            fds.push(PollFd::new(run.stderr.as_fd(), PollFlags::POLLIN));
        }
        if let Some(c) = claimer {
            fds.push(PollFd::new(c, PollFlags::POLLIN));
        }
        if end_open {
            fds.push(PollFd::new(run.ended.as_fd(), PollFlags::POLLIN));
        }
        let idle = Duration::from_millis(crate::residency::IDLE_MS_BEFORE_DROP.into());
        let wait = match (&later, dropped_file_pages) {
            (Some(l), false) => Some(l.at.saturating_duration_since(Instant::now()).min(idle)),
            (Some(l), true) => Some(l.at.saturating_duration_since(Instant::now())),
            (None, false) => Some(idle),
            (None, true) => None,
        };
        let timeout = wait
            .map(|w| PollTimeout::try_from(w).unwrap_or(PollTimeout::MAX))
            .unwrap_or(PollTimeout::NONE);
        match poll(&mut fds, timeout) {
            Err(_) => continue,
            Ok(0) => {
                drop(fds);
                if later.as_ref().is_some_and(|l| l.at <= Instant::now()) {
                    if let Some(l) = later.take() {
                        (l.work)();
                    }
                } else if !dropped_file_pages {
                    if let (Some(renew), None, None) = (renew, &later, claimer) {
                        renew();
                    }
                    crate::residency::drop_idle_memory();
                    dropped_file_pages = true;
                }
                continue;
            }
            Ok(_) => {}
        }
        let ready: Vec<bool> = fds
            .iter()
            .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        drop(fds);
        let mut idx = 2;
        for (which, file) in [(0, &run.stdout), (1, &run.stderr)] {
            if open[which] {
                if ready[idx] && !relay(which, file, &mut log) {
                    open[which] = false;
                }
                idx += 1;
            }
        }
        let end_idx = idx + usize::from(claimer.is_some());
        if let Some(c) = claimer {
            if ready[idx] {
                use crate::lifecycle::shell::wire::{recv, ToMonitor};
                match recv::<ToMonitor>(c) {
                    Ok(Some((ToMonitor::Signal { signo }, _))) => {
                        if let Ok(sig) = Signal::try_from(signo) {
                            // As below: ESRCH means init is exiting.
                            let _ = kill(run.init, sig);
                        }
                    }
                    // Nothing else is asked of a claimed box.
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => {
                        // The caller is gone: so is its box. ESRCH: init
                        // is exiting anyway.
                        let _ = kill(run.init, Signal::SIGKILL);
                        abandoned = true;
                        claimer = None;
                    }
                }
            }
        }
        if ready[1] {
            while let Ok(Some(info)) = signals.read_signal() {
                if let Ok(sig) = Signal::try_from(info.ssi_signo as i32) {
                    // ESRCH: init is exiting; its end is seen on the pidfd.
                    let _ = kill(run.init, sig);
                }
            }
        }
        if end_open && ready[end_idx] {
            let mut word = [0u8; 4];
            match (&run.ended).read(&mut word) {
                Ok(4) => said_ended = Some(i32::from_le_bytes(word)),
                // End of file (init is gone without saying it, or a read
                // error): its exit, on the pidfd, ends the box.
                _ => end_open = false,
            }
            if said_ended.is_some() {
                break;
            }
        }
        if ready[0] {
            break;
        }
    }
    crate::phases::mark("monitor: box ended");
    let code = match said_ended {
        Some(code) => code,
        None => run.reap().unwrap_or(crate::error::EXIT_NESTBOX_ERROR),
    };
    // The box's processes are gone with its init; drain what they wrote (bounded).
    let deadline = Instant::now() + Duration::from_secs(2);
    for (which, file) in [(0, &run.stdout), (1, &run.stderr)] {
        while open[which] && Instant::now() < deadline {
            let mut fds = [PollFd::new(file.as_fd(), PollFlags::POLLIN)];
            if poll(&mut fds, PollTimeout::from(100u8)).unwrap_or(0) == 0
                || !relay(which, file, &mut log)
            {
                open[which] = false;
            }
        }
    }
    if foreground {
        // As for the writes above: a terminal gone, the log has it.
        let _ = std::io::stdout().flush();
    }
    (code, abandoned, later)
}

/// Record the end of the box and release its cgroup.
/// Release what ended box `record` holds outside its record: its processes
/// and `cgroup` (killed, removed), its address on a bridge network. What
/// cannot be removed now is logged, and `gc` removes it later.
pub(crate) fn release_ended(reg: &Registry, record: &BoxRecord, cgroup: Option<&BoxCgroup>) {
    let name = Some(record.name());
    if let Some(cg) = cgroup {
        crate::diag::warn_on_err(name, "killing the box's processes", cg.kill_all());
        crate::diag::warn_on_err(name, "removing the cgroup", cg.remove());
    }
    crate::phases::mark("monitor: cgroup removed");
    // Only a bridged box holds anything on the network.
    if record.spec.network.mode == NetworkMode::Bridge {
        let released = crate::network::release_exited(reg.roots(), &record.state.id);
        crate::diag::warn_on_err(name, "releasing the network", released);
    }
    crate::phases::mark("monitor: network released");
}

/// Record box `record`'s end: exited with `exit_code`, its final `stats`,
/// whether the OOM killer ended it; its cgroup no longer its (removed by
/// [`release_ended`]; should the monitor die first, `gc` removes it once the
/// box is removed).
pub(crate) fn record_exited(
    reg: &Registry,
    record: &BoxRecord,
    exit_code: i32,
    oom_killed: bool,
    stats: Option<nestbox_cgroup::Stats>,
) -> Result<()> {
    reg.update(record.name(), |s| {
        s.status = Status::Exited;
        s.exit_code = Some(exit_code);
        s.finished_at = Some(now());
        s.oom_killed = oom_killed;
        s.final_stats = stats;
        s.cgroup = None;
        if oom_killed {
            s.error = Some(oom_message(&record.spec));
        }
    })
    .map(drop)
}

pub(crate) fn finish(
    reg: &Registry,
    record: &BoxRecord,
    run: Running,
    exit_code: i32,
) -> Result<Outcome> {
    // A pooled clone is renamed when claimed: find the record by id. Other
    // boxes keep their name for life.
    let current;
    let record = if record.spec.clone_of.is_none() {
        record
    } else {
        match reg.load(record.name()) {
            Ok(r) if r.state.id == record.state.id => record,
            _ => match reg.load_by_id(&record.state.id) {
                Ok(r) => {
                    current = r;
                    &current
                }
                Err(_) => record,
            },
        }
    };
    // Init said the box ended and exits: gone from the cgroup before it is removed.
    run.reap();
    let mut oom_kills = 0;
    let mut stats = None;
    if let Some(cg) = &run.cgroup {
        oom_kills = cg.oom_kills().unwrap_or(0);
        // The final figures are kept for `inspect` of an exited box; a box
        // removed on exit has no one to show them to.
        if !record.spec.remove_on_exit {
            stats = match cg.stats() {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(box_name = record.name(), "reading the final stats: {e}");
                    None
                }
            };
        }
    }
    release_ended(reg, record, run.cgroup.as_ref());
    let oom_killed = oom_kills > 0 && exit_code == 128 + Signal::SIGKILL as i32;
    // A template removed while clones depended on it goes once its init has.
    let removed_template = || {
        reg.load(record.name())
            .is_ok_and(|r| r.state.template.is_some_and(|t| t.removed))
    };
    if record.spec.remove_on_exit || removed_template() {
        reg.remove(record)?;
    } else {
        record_exited(reg, record, exit_code, oom_killed, stats)?;
    }
    crate::phases::mark("monitor: record removed or updated");
    if let Some(ns) = run.mount_ns {
        crate::process::release_in_background(ns);
    }
    crate::phases::mark("monitor: mount namespace handed off");
    Ok(Outcome {
        exit_code,
        oom_killed,
    })
}

/// The one line that reports an OOM kill.
pub fn oom_message(spec: &BoxSpec) -> String {
    // Inside a box, the limit of the box this one runs in (or of one above
    // it) bounds it too, and may be the one that was reached.
    let outer = if nestbox_isolation::idmap::in_user_namespace() {
        " (or that of the box it runs in)"
    } else {
        ""
    };
    match spec.limits.memory {
        Some(m) => format!(
            "box {:?} was killed by the kernel's OOM killer: its memory limit of {}{outer} was reached",
            spec.name,
            crate::size::format_size(m)
        ),
        None if !outer.is_empty() => format!(
            "box {:?} was killed by the kernel's OOM killer: the memory limit of the box it runs in was reached",
            spec.name
        ),
        None => format!("box {:?} was killed by the kernel's OOM killer", spec.name),
    }
}

impl Running {
    /// Wait for init to exit and reap it (once): before the box's cgroup is
    /// removed, which its exiting init may still be in. Its exit code when
    /// this call reaped it.
    pub(crate) fn reap(&self) -> Option<i32> {
        if self.reaped.replace(true) {
            return None;
        }
        Some(crate::process::wait_exit_code(self.init))
    }
}
