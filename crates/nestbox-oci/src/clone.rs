//! Containers forked from a nestbox template: a config whose annotation
//! `nestbox.template=NAME` makes `create` fork the container from template
//! NAME (the library code of `nestbox clone`) instead of starting it cold.
//!
//! **Who waits on what.** An OCI caller (conmon, the containerd shim) is a
//! subreaper: it reads the pid `create` reports and collects that process's
//! exit status when it is re-parented to the caller. A nestbox clone is a box
//! whose processes are children of its *monitor* (through the box's init),
//! and the monitor exits with the clone's status (128 + N when killed by
//! signal N) once the clone has ended and the box is cleaned up. The clone's
//! own process is a child of the box's init in the box's pid namespace: the
//! kernel never makes it a child of the caller, so the caller could not reap
//! it. So `create` forks a *waiter* (the pid it reports), which forks the
//! clone's shell with the monitor as its own child ([`CloneRequest::fork_now`]:
//! never a pooled clone, whose monitor belongs to nobody), records the
//! container, enters the clone's mount namespace (so that tools that list a
//! container's processes through its pid's mount namespace, `podman top`,
//! see the clone's /proc), then waits for the monitor and exits with its
//! status. When `create` exits, the waiter is adopted by the caller, which
//! reaps it and reads the container's exit status from it, as it reads it
//! from runc's init. The clone's own process (the template's continued
//! state) is recorded beside it: `kill` signals it, `exec` joins its
//! namespaces, and `ps`, `pause`, `resume`, `update` and `events` act on the
//! box's cgroup.
//!
//! **Streams.** The clone's descriptors 0, 1 and 2 are the streams `create`
//! was given (conmon's pipes, the shim's fifos), or with `process.terminal`
//! the slave of a terminal whose master goes over `--console-socket` (not
//! the clone's controlling terminal: the clone keeps the template's session).
//!
//! **Created, then started.** The clone is forked with `SIGSTOP` delivered
//! as it is let go, so it runs nothing of its own between `create` and
//! `start`; `start` wakes its processes with `SIGCONT` (children first).
//!
//! `delete` removes the box as `nestbox rm -f` does (cgroup, writable layer,
//! record). The box lives in the nestbox root given by the annotation
//! `nestbox.root=DIR` (else `NESTBOX_ROOT`, else the system root), the root
//! the template is in.
//!
//! **Checkpoint and restore.** Such a container is a nestbox box, so
//! `checkpoint` saves it with nestbox's own engine (`nestbox checkpoint -o`)
//! and `restore` makes a new box from the image (`nestbox restore`), whose
//! monitor (a child of `nestbox-runc`) is reported and reaped. (A container
//! started cold is saved as a whole pid namespace: [`crate::checkpoint`].)

use std::path::{Path, PathBuf};

use nestbox_runtime::clone::CloneRequest;
use nestbox_runtime::paths::Roots;
use nestbox_runtime::registry::Registry;
use serde::{Deserialize, Serialize};

use crate::config::Plan;
use crate::create::CreateOpts;
use crate::state::{self, Record, Root, Status};
use crate::{hooks, OciError, Result};

/// The annotation naming the template a container is forked from.
pub const TEMPLATE_ANNOTATION: &str = "nestbox.template";
/// The annotation naming the nestbox root the template is in.
pub const ROOT_ANNOTATION: &str = "nestbox.root";

/// What a container forked from a template is, beside its record.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CloneLink {
    /// The nestbox root's runtime state directory.
    pub run: PathBuf,
    /// The nestbox root's persistent data directory.
    pub lib: PathBuf,
    /// The template (empty for a container restored from a checkpoint).
    #[serde(default)]
    pub template: String,
    /// The clone's box name in that root.
    pub name: String,
    /// Host pid of the clone's process (the template's process continued).
    pub process: i32,
    /// Its start time, to tell a reused pid.
    pub process_start: u64,
    /// Host pids of its other processes (a template with a process tree).
    #[serde(default)]
    pub others: Vec<i32>,
}

impl CloneLink {
    fn registry(&self) -> Registry {
        Registry::new(Roots {
            run: self.run.clone(),
            lib: self.lib.clone(),
        })
    }

    /// Whether the clone's process still runs.
    pub fn alive(&self) -> bool {
        state::alive(self.process, self.process_start)
    }
}

/// The template a config asks to be forked from, if any.
pub fn template_of(plan: &Plan) -> Option<&str> {
    plan.annotations
        .get(TEMPLATE_ANNOTATION)
        .map(String::as_str)
}

fn nestbox_error(what: String) -> impl FnOnce(nestbox_runtime::RuntimeError) -> OciError {
    move |source| OciError::Nestbox {
        what,
        error: Box::new(source),
    }
}

/// The nestbox registry a config names (`nestbox.root`, else `NESTBOX_ROOT`,
/// else the system root).
fn registry_of(plan: &Plan) -> Registry {
    Registry::new(Roots::resolve(
        plan.annotations.get(ROOT_ANNOTATION).map(Path::new),
    ))
}

/// Create container `opts.id` by forking template `template`: on success it
/// is `created`, its processes stopped until `start`; on failure nothing of
/// it is left (no record, no box).
///
/// The work is done by a child of this process, the container's *waiter*
/// (the pid reported): it forks the clone (whose monitor is thus the
/// waiter's child), records the container, enters the clone's mount
/// namespace, reports `ok` and then waits for the monitor and exits with its
/// status. This process returns once the waiter has reported.
pub fn create(root: &Root, opts: &CreateOpts, plan: &Plan, template: &str) -> Result<Record> {
    if template.is_empty() {
        return Err(OciError::Unsupported(format!(
            "annotation {TEMPLATE_ANNOTATION} must name a template"
        )));
    }
    if opts.preserve_fds > 0 {
        return Err(OciError::Usage(format!(
            "--preserve-fds: a container forked from a template ({TEMPLATE_ANNOTATION}) keeps its template's descriptors"
        )));
    }
    if plan.process.is_none() {
        return Err(OciError::Unsupported(format!(
            "a container forked from a template ({TEMPLATE_ANNOTATION}) needs a process section (its process is the template's)"
        )));
    }
    let stdio = crate::streams::for_clone(opts.console_socket.as_deref())?;
    let (report_r, report_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| OciError::sys("pipe2", e))?;
    // SAFETY: nestbox-runc is single-threaded (it starts no thread before
    // this point), and the flags are empty: a plain fork.
    let forked =
        unsafe { nestbox_isolation::namespaces::fork_into(nix::sched::CloneFlags::empty()) }?;
    match forked {
        nestbox_sys::process::Forked::Child => {
            drop(report_r);
            let code = waiter(root, opts, plan, template, stdio, report_w);
            nestbox_sys::process::exit_now(code)
        }
        nestbox_sys::process::Forked::Parent(waiter) => {
            drop(report_w);
            drop(stdio);
            let mut text = String::new();
            // A read error leaves `text` short: read as "the waiter died".
            let _ = std::io::Read::read_to_string(&mut std::fs::File::from(report_r), &mut text);
            if text == "ok" {
                return root.load(&opts.id);
            }
            // It has reported its error (after undoing what it made), or died.
            let _ = nix::sys::wait::waitpid(waiter, None);
            if text.is_empty() {
                remove_left_behind(root, &opts.id, plan);
            }
            Err(if text.is_empty() {
                OciError::Setup {
                    id: opts.id.clone(),
                    message: "the container's process exited during set-up".into(),
                }
            } else {
                OciError::Relayed(text)
            })
        }
    }
}

/// The signals a waiter passes on to the clone's process.
const FORWARDED_SIGNALS: &[nix::sys::signal::Signal] = {
    use nix::sys::signal::Signal::*;
    // (Not SIGCONT: a created clone waits, stopped, for `start`.)
    &[SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH]
};

/// What a waiter killed before it could report (or undo) may have left of
/// container `id`: its clone box and its record (best effort; both names
/// are this container's alone: the record's directory was reserved by the
/// waiter, the box is named after the runtime root and the id).
fn remove_left_behind(root: &Root, id: &str, plan: &Plan) {
    let reg = registry_of(plan);
    let name = crate::create::cgroup_id(root, id);
    if reg.load(&name).is_ok() {
        if let Err(e) = nestbox_runtime::ops::remove(&reg, &name, true) {
            tracing::warn!("removing the clone of a failed create: {e}");
        }
    }
    let dir = root.container_dir(id);
    if dir.exists() {
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            tracing::warn!("removing {}: {e}", dir.display());
        }
    }
}

/// The waiter's life (see [`create`]): make the container, report, wait for
/// the clone's monitor; its exit code.
fn waiter(
    root: &Root,
    opts: &CreateOpts,
    plan: &Plan,
    template: &str,
    stdio: [std::os::fd::OwnedFd; 3],
    report: std::os::fd::OwnedFd,
) -> i32 {
    let (monitor, process) = match make(root, opts, plan, template, stdio) {
        Ok(made) => made,
        Err(e) => {
            // Nothing of the container is left (make undoes it); the caller
            // prints the error.
            let _ = nix::unistd::write(&report, format!("{e:#}").as_bytes());
            return 1;
        }
    };
    // The caller's streams are the clone's now: the waiter keeps none of them
    // (and writes nothing after this).
    crate::streams::release_own();
    if nix::unistd::write(&report, b"ok").is_err() {
        // The caller died: it never saw the container made. The container
        // stays, as a `create` killed after its record was saved leaves it
        // (`delete --force` removes it).
        tracing::warn!("create: the caller went before the container was reported");
    }
    drop(report);
    // The waiter stands for the clone's process: a signal sent to the pid
    // the caller knows goes on to it, as it would reach runc's container
    // process (best effort: without it, `kill` still reaches the clone).
    let forwarded = nestbox_sys::pidfd::pidfd_open(process)
        .and_then(|fd| nestbox_sys::process::forward_signals(fd, FORWARDED_SIGNALS));
    if let Err(e) = forwarded {
        tracing::warn!("create: signals to the waiter will not reach the clone: {e}");
    }
    crate::ops::wait_exit_code(nix::unistd::Pid::from_raw(monitor))
}

/// Make the clone and record the container with this process (the waiter)
/// as its pid, and move into the clone's mount namespace; the monitor's pid
/// and the clone's process's. On failure nothing of the container is left.
fn make(
    root: &Root,
    opts: &CreateOpts,
    plan: &Plan,
    template: &str,
    stdio: [std::os::fd::OwnedFd; 3],
) -> Result<(i32, i32)> {
    let reg = registry_of(plan);
    let dir = root.reserve(&opts.id)?;
    let name = crate::create::cgroup_id(root, &opts.id);
    let mut undo = Undo {
        dir: Some(dir),
        reg: None,
        name: name.clone(),
    };
    let req = CloneRequest {
        names: vec![name.clone()],
        count: 1,
        // The config's limits when it gives any, else the template's.
        limits: (plan.limits != nestbox_cgroup::Limits::default()).then(|| plan.limits.clone()),
        on_clone_signal: Some(nix::sys::signal::Signal::SIGSTOP),
        fork_now: true,
        stdio: Some(std::sync::Arc::new(stdio)),
        ..CloneRequest::default()
    };
    undo.reg = Some(reg.clone());
    let made = nestbox_runtime::clone::clone_template(&reg, template, &req)
        .map_err(nestbox_error(format!("{TEMPLATE_ANNOTATION} {template:?}")))?;
    // This process holds the streams no longer: the clone has its copies.
    drop(req);
    let cloned = made.into_iter().next().ok_or_else(|| OciError::Setup {
        id: opts.id.clone(),
        message: "the template made no clone".into(),
    })?;
    let marker = root.clone_created_marker(&opts.id);
    std::fs::write(&marker, b"").map_err(|e| OciError::io("write", &marker, e))?;
    let me = std::process::id() as i32;
    let gone = || OciError::Setup {
        id: opts.id.clone(),
        message: "the clone ended as soon as it was forked".into(),
    };
    let boxed = reg
        .load(&name)
        .map_err(nestbox_error(format!("clone {name:?}")))?;
    let (monitor, init) = match (boxed.state.monitor, boxed.state.init) {
        (Some(m), Some(i)) => (m.pid, i.pid),
        _ => return Err(gone()),
    };
    // The clone's mount namespace, opened while the clone certainly lives.
    let ns_path = PathBuf::from(format!("/proc/{init}/ns/mnt"));
    let mnt = std::fs::File::open(&ns_path).map_err(|_| gone())?;
    let (_, my_start) = state::proc_stat(me).ok_or_else(|| OciError::Setup {
        id: opts.id.clone(),
        message: "cannot read the waiter's own start time".into(),
    })?;
    record(
        root,
        opts,
        plan,
        &reg,
        template,
        &name,
        (me, my_start),
        cloned.pid,
        cloned.others.clone(),
    )?;
    // Last, as it changes what paths mean: the waiter enters the clone's
    // mount namespace, so that a tool that lists a container's processes
    // through the reported pid's mount namespace (`podman top`: the /proc
    // mounted there) lists the clone's.
    if let Err(e) = enter_mount_namespace(&mnt) {
        if let Some(p) = &opts.pid_file {
            let _ = std::fs::remove_file(p);
        }
        return Err(OciError::sys(
            format!("setns(mnt) {} (the clone's)", ns_path.display()),
            e,
        ));
    }
    undo.forget();
    Ok((monitor, cloned.pid))
}

/// Join the mount namespace `ns`. `setns` refuses (`EINVAL`) while another
/// thread shares this process's file-system information: a helper thread of
/// the clone, joined already, may take a moment more to release it.
fn enter_mount_namespace(ns: &std::fs::File) -> std::result::Result<(), nix::errno::Errno> {
    use std::os::fd::AsFd;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    loop {
        match nestbox_sys::ns::enter(ns.as_fd(), nestbox_sys::ns::Namespace::Mnt) {
            Err(nix::errno::Errno::EINVAL) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            other => return other,
        }
    }
}

/// Record container `opts.id`, the box `name` of `reg` whose process is
/// `process`, reported as `pid` (with its start time): run the create-stage
/// hooks, save the record and the pid file.
#[allow(clippy::too_many_arguments)]
fn record(
    root: &Root,
    opts: &CreateOpts,
    plan: &Plan,
    reg: &Registry,
    template: &str,
    name: &str,
    pid: (i32, u64),
    process: i32,
    others: Vec<i32>,
) -> Result<Record> {
    let roots = reg.roots();
    let gone = || OciError::Setup {
        id: opts.id.clone(),
        message: "the clone ended as soon as it was forked".into(),
    };
    let (_, process_start) = state::proc_stat(process).ok_or_else(gone)?;
    let link = CloneLink {
        run: roots.run.clone(),
        lib: roots.lib.clone(),
        template: template.to_string(),
        name: name.to_string(),
        process,
        process_start,
        others,
    };
    let boxed = reg
        .load(name)
        .map_err(nestbox_error(format!("clone {name:?}")))?;
    let rec = Record {
        id: opts.id.clone(),
        pid: pid.0,
        start_time: pid.1,
        bundle: plan.bundle.clone(),
        rootfs: plan.rootfs.clone(),
        created: state::now_rfc3339(),
        annotations: plan.annotations.clone(),
        cgroup: boxed.state.cgroup.clone(),
        no_process: false,
        hooks: hooks::Hooks {
            prestart: Vec::new(),
            create_runtime: Vec::new(),
            create_container: Vec::new(),
            ..plan.hooks.clone()
        },
        clone: Some(link),
    };
    let creating = crate::create::state_text(&rec, "created");
    hooks::run("prestart", &plan.hooks.prestart, &creating)?;
    hooks::run("createRuntime", &plan.hooks.create_runtime, &creating)?;
    hooks::run("createContainer", &plan.hooks.create_container, &creating)?;
    root.save(&rec)?;
    if let Some(p) = &opts.pid_file {
        crate::create::write_pid_file(p, rec.pid)?;
    }
    Ok(rec)
}

/// What a failed clone `create` must undo: the box, then the record's directory.
struct Undo {
    dir: Option<PathBuf>,
    reg: Option<Registry>,
    name: String,
}

impl Undo {
    fn forget(&mut self) {
        self.dir = None;
        self.reg = None;
    }
}

impl Drop for Undo {
    fn drop(&mut self) {
        if let Some(reg) = self.reg.take() {
            // A failed clone_template removes its own shell: then there is no box.
            if reg.load(&self.name).is_ok() {
                if let Err(e) = nestbox_runtime::ops::remove(&reg, &self.name, true) {
                    tracing::warn!("removing the clone of a failed create: {e}");
                }
            }
        }
        if let Some(dir) = self.dir.take() {
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                tracing::warn!("removing {}: {e}", dir.display());
            }
        }
    }
}

/// `start` of a clone: its processes go on (children first, so a parent
/// wakes to a complete tree).
pub fn start(root: &Root, rec: &Record, link: &CloneLink) -> Result<()> {
    let marker = root.clone_created_marker(&rec.id);
    std::fs::remove_file(&marker).map_err(|e| OciError::io("remove", &marker, e))?;
    for pid in link.others.iter().rev().chain([&link.process]) {
        // A process of the tree that has exited meanwhile needs no waking.
        let _ = nestbox_sys::process::tgkill(*pid, *pid, libc::SIGCONT);
    }
    if !link.alive() {
        return Err(crate::create::wrong(
            &rec.id,
            Status::Stopped,
            "its process exited before start",
        ));
    }
    Ok(())
}

/// Remove the clone's box (killing what still runs in it), as `nestbox rm -f`.
pub fn remove(link: &CloneLink) -> Result<()> {
    let reg = link.registry();
    match nestbox_runtime::ops::remove(&reg, &link.name, true) {
        Ok(()) | Err(nestbox_runtime::RuntimeError::NoSuchBox(_)) => Ok(()),
        Err(e) => Err(OciError::Nestbox {
            what: format!("clone {:?}", link.name),
            error: Box::new(e),
        }),
    }
}

/// `checkpoint` of a container that is a nestbox box (forked from a
/// template, or restored from a box's checkpoint): saved to `image` (which
/// must not exist) with nestbox's checkpoint engine as a self-contained
/// checkpoint (`nestbox checkpoint -o`); its box is stopped afterwards
/// unless `leave_running`.
pub(crate) fn checkpoint(
    link: &CloneLink,
    image: &Path,
    leave_running: bool,
) -> nestbox_runtime::Result<()> {
    let req = nestbox_runtime::checkpoint::CheckpointRequest {
        name: None,
        leave_running,
        output: Some(image.to_path_buf()),
    };
    nestbox_runtime::checkpoint::checkpoint(&link.registry(), &link.name, &req).map(|_| ())
}

/// `restore ID`: a new container made from the checkpoint in `image` (of a
/// container that was a nestbox box), running; its record and hooks are
/// those of the bundle's config, its box in the root the config names.
pub(crate) fn restore(root: &Root, opts: &CreateOpts, image: &Path) -> Result<Record> {
    let plan = crate::checkpoint::restore_plan(
        root,
        opts,
        "a restored container keeps its checkpoint's standard streams",
    )?;
    let reg = registry_of(&plan);
    let dir = root.reserve(&opts.id)?;
    let name = crate::create::cgroup_id(root, &opts.id);
    let mut undo = Undo {
        dir: Some(dir),
        reg: Some(reg.clone()),
        name: name.clone(),
    };
    let source = image.to_string_lossy().into_owned();
    // nestbox's restore forks a helper into the new box's pid namespace from
    // a child of ours that exits at once; the helper is killed once the
    // restore is done. As a subreaper, this process is the one it is
    // re-parented to, and reaps it below: otherwise it would go to the
    // caller's subreaper, and until someone reaps it the box's init cannot
    // finish when the box ends.
    nix::sys::prctl::set_child_subreaper(true)
        .map_err(|e| OciError::sys("prctl(PR_SET_CHILD_SUBREAPER)", e))?;
    let restored = nestbox_runtime::checkpoint::restore(&reg, &source, Some(&name));
    let monitor = reg.load(&name).ok().and_then(|b| b.state.monitor);
    reap_helpers(monitor.map(|m| m.pid));
    let restored = restored.map_err(nestbox_error(format!("restore of {}", image.display())))?;
    let monitor = reg
        .load(&name)
        .ok()
        .and_then(|b| b.state.monitor)
        .ok_or_else(|| OciError::Setup {
            id: opts.id.clone(),
            message: "the clone ended as soon as it was forked".into(),
        })?;
    let rec = record(
        root,
        opts,
        &plan,
        &reg,
        "",
        &name,
        (monitor.pid, monitor.start_time),
        restored.pid,
        Vec::new(),
    )?;
    undo.forget();
    hooks::run_warning(
        "poststart",
        &rec.hooks.poststart,
        &crate::create::state_text(&rec, "running"),
    );
    Ok(rec)
}

/// Reap this process's children but `keep` (the restored box's monitor,
/// which the caller reaps once this process has exited): the restore's
/// helpers, killed by the restore, may take a moment to exit (one second at
/// most is waited for).
fn reap_helpers(keep: Option<i32>) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    loop {
        let me = std::process::id();
        let children: Vec<i32> = std::fs::read_to_string(format!("/proc/{me}/task/{me}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .filter(|p| Some(*p) != keep)
            .collect();
        if children.is_empty() || std::time::Instant::now() >= deadline {
            return;
        }
        for pid in children {
            // Only those that have exited; a live one is looked at again.
            let _ = nix::sys::wait::waitpid(
                nix::unistd::Pid::from_raw(pid),
                Some(nix::sys::wait::WaitPidFlag::WNOHANG),
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}
