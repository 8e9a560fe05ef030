//! `create` and `start`: the container's process is forked into its
//! namespaces and cgroup, sets itself up and waits on `exec.fifo`; `create`
//! records the container and returns. `start` writes to the fifo, which lets
//! the process `execve` the user's program.
//!
//! The container's process is the one whose pid `create` reports: when
//! `create` exits, it is adopted by the caller's subreaper (conmon, the
//! containerd shim) exactly as runc's is, which then collects its exit status.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nestbox_cgroup::{BoxCgroup, Hierarchies};
use nestbox_sys::ns::Namespace;
use nix::fcntl::OFlag;
use nix::unistd::Pid;

use crate::child::{self, ChildFds};
use crate::config::{self, Plan};
use crate::state::{self, Record, Root, Status};
use crate::{hooks, OciError, Result};

/// Options of `create` (and of `run`).
#[derive(Debug, Clone)]
pub struct CreateOpts {
    /// Container id.
    pub id: String,
    /// Bundle directory.
    pub bundle: PathBuf,
    /// Where to write the container's pid.
    pub pid_file: Option<PathBuf>,
    /// Where to send the terminal's master.
    pub console_socket: Option<PathBuf>,
    /// `--preserve-fds N`: the runtime's descriptors 3 to 3 + N - 1 are
    /// passed to the container's program.
    pub preserve_fds: u32,
}

/// The name of the container's cgroup: nestbox-cgroup ids are `[a-z0-9-]`,
/// OCI ids are not, so the id is hashed (with the root, so two runtime
/// roots never collide).
pub fn cgroup_id(root: &Root, id: &str) -> String {
    // FNV-1a, 64 bits: stable across builds and versions.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in root
        .dir()
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .chain([0u8].iter())
        .chain(id.as_bytes())
    {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("oci-{h:016x}")
}

/// Create container `opts.id`: on success it is `created`, its process
/// waiting for `start`; on failure nothing of it is left.
pub fn create(root: &Root, opts: &CreateOpts) -> Result<Record> {
    state::validate_id(&opts.id)?;
    if root.container_dir(&opts.id).exists() {
        return Err(OciError::Exists(opts.id.clone()));
    }
    let plan = config::load(&opts.bundle)?;
    match (plan.process.terminal, &opts.console_socket) {
        (true, None) => {
            return Err(OciError::Usage(
                "process.terminal is true: --console-socket is required".into(),
            ))
        }
        (false, Some(_)) => {
            return Err(OciError::Usage(
                "--console-socket given but process.terminal is false".into(),
            ))
        }
        _ => {}
    }
    if let Some(template) = crate::clone::template_of(&plan) {
        return crate::clone::create(root, opts, &plan, template);
    }
    let dir = root.reserve(&opts.id)?;
    let mut made = Made {
        dir: Some(dir),
        cgroup: None,
        pid: None,
    };
    let rec = build(root, opts, &plan, &mut made, None)?;
    made.forget();
    Ok(rec)
}

/// `restore` of a container started cold: container `opts.id` made from
/// the bundle's config as `create` makes it (cgroup, namespaces, root,
/// mounts, hooks of the create stage), its process the stub that `image`'s
/// pid 1 is restored into (its children forked by it), running; the
/// `poststart` hooks run. On failure nothing of it is left.
pub fn restore(
    root: &Root,
    opts: &CreateOpts,
    plan: &Plan,
    image: &nestbox_runtime::nscheckpoint::NamespaceImage,
) -> Result<Record> {
    let dir = root.reserve(&opts.id)?;
    let mut made = Made {
        dir: Some(dir),
        cgroup: None,
        pid: None,
    };
    let rec = build(root, opts, plan, &mut made, Some(image))?;
    made.forget();
    hooks::run_warning(
        "poststart",
        &rec.hooks.poststart,
        &state_text(&rec, "running"),
    );
    Ok(rec)
}

/// What a failed `create` must undo.
struct Made {
    dir: Option<PathBuf>,
    cgroup: Option<BoxCgroup>,
    pid: Option<Pid>,
}

impl Made {
    fn forget(&mut self) {
        self.dir = None;
        self.cgroup = None;
        self.pid = None;
    }
}

impl Drop for Made {
    fn drop(&mut self) {
        if let Some(pid) = self.pid.take() {
            // The process may have exited already; either way it is reaped here.
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            let _ = nix::sys::wait::waitpid(pid, None);
        }
        if let Some(cg) = self.cgroup.take() {
            if let Err(e) = cg.kill_all().and_then(|()| cg.remove()) {
                tracing::warn!("removing the cgroup of a failed create: {e}");
            }
        }
        if let Some(dir) = self.dir.take() {
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                tracing::warn!("removing {}: {e}", dir.display());
            }
        }
    }
}

fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| OciError::sys("pipe2", e))
}

/// Make the container: its process waits for `start` on the fifo, or, with
/// `restore`, is made that image's pid 1 (then running).
fn build(
    root: &Root,
    opts: &CreateOpts,
    plan: &Plan,
    made: &mut Made,
    restore: Option<&nestbox_runtime::nscheckpoint::NamespaceImage>,
) -> Result<Record> {
    let h = Hierarchies::detect()?;
    let cg_id = cgroup_id(root, &opts.id);
    let pending = match &plan.cgroups_path {
        Some(path) => BoxCgroup::prepare_at(&h, &cg_id, path, &plan.limits)?,
        None => BoxCgroup::prepare(&h, &cg_id, &plan.limits)?,
    };
    let cg = pending.create()?;
    made.cgroup = Some(cg.clone());
    if let Some(rules) = &plan.device_rules {
        // Before the process joins the cgroup: it opens no device unchecked.
        cg.set_device_rules(&crate::resources::full_device_rules(rules, &plan.devices))?;
    }
    // A restored container is running when made: it has no fifo.
    let fifo = match restore {
        None => Some(exec_fifo(root, &opts.id)?),
        Some(_) => None,
    };
    let console = match &opts.console_socket {
        Some(p) => Some(crate::console::connect(p)?),
        None => None,
    };
    if let Some(path) = plan
        .namespaces
        .iter()
        .find(|n| n.kind == Namespace::Pid)
        .and_then(|n| n.path.as_ref())
    {
        // Joining a pid namespace changes only where children are born.
        let f = std::fs::File::open(path).map_err(|e| OciError::io("open namespace", path, e))?;
        use std::os::fd::AsFd;
        nestbox_sys::ns::enter(f.as_fd(), Namespace::Pid)
            .map_err(|e| OciError::sys(format!("setns(pid) {}", path.display()), e))?;
    }
    let (go_r, go_w) = pipe()?;
    let (rep_r, rep_w) = pipe()?;
    // SAFETY: the runtime is single-threaded (it starts no thread), and the
    // flags hold only CLONE_NEWPID / CLONE_NEWUSER.
    let forked = unsafe { nestbox_isolation::namespaces::fork_into(child::clone_flags(plan)) }?;
    let pid = match forked {
        nestbox_sys::process::Forked::Child => {
            drop(go_w);
            drop(rep_r);
            child::run(
                plan,
                ChildFds {
                    go: go_r,
                    report: rep_w,
                    console,
                    fifo,
                    preserve_fds: opts.preserve_fds,
                    restore_stub: restore.is_some(),
                },
            )
        }
        nestbox_sys::process::Forked::Parent(pid) => pid,
    };
    made.pid = Some(pid);
    drop(go_r);
    drop(rep_w);
    drop(fifo);
    drop(console);
    if plan.new_namespace(Namespace::User) {
        write_id_maps(pid, plan)?;
    }
    cg.add_process(pid.as_raw())?;
    let (_, start_time) = state::proc_stat(pid.as_raw()).ok_or_else(|| OciError::Setup {
        id: opts.id.clone(),
        message: "the container's process exited".into(),
    })?;
    let rec = Record {
        id: opts.id.clone(),
        pid: pid.as_raw(),
        start_time,
        bundle: plan.bundle.clone(),
        rootfs: plan.rootfs.clone(),
        created: state::now_rfc3339(),
        annotations: plan.annotations.clone(),
        cgroup: Some(cg),
        no_process: plan.process.is_none(),
        hooks: hooks::Hooks {
            prestart: Vec::new(),
            create_runtime: Vec::new(),
            create_container: Vec::new(),
            ..plan.hooks.clone()
        },
        clone: None,
    };
    nix::unistd::write(&go_w, b"1").map_err(|e| OciError::sys("write go pipe", e))?;
    // The hook point (child::hook_point): the container's namespaces are
    // made; prestart and createRuntime run here, in the runtime's, then the
    // process runs createContainer in the container's. The validation suite
    // of the runtime spec expects "created" in their state.
    wait_hook_point(&rep_r, &opts.id)?;
    let creating = state_text(&rec, "created");
    hooks::run("prestart", &plan.hooks.prestart, &creating)?;
    hooks::run("createRuntime", &plan.hooks.create_runtime, &creating)?;
    nix::unistd::write(&go_w, creating.as_bytes())
        .map_err(|e| OciError::sys("write go pipe", e))?;
    drop(go_w);
    wait_ready(&rep_r, &opts.id)?;
    if let Some(image) = restore {
        // The stub, set up and blocked, becomes the image's pid 1; its
        // standard streams are ours (the caller's: conmon's pipes, the
        // shim's fifos), as a created container's are.
        // SAFETY: 0, 1 and 2 stay open in this process for the call.
        let stdio = unsafe {
            [0, 1, 2].map(|fd| std::os::fd::BorrowedFd::borrow_raw(fd as std::os::fd::RawFd))
        };
        image
            .restore(pid.as_raw(), stdio, plan.seccomp.as_ref())
            .map_err(|e| OciError::Nestbox {
                what: format!("restore of container {:?}", opts.id),
                error: Box::new(e),
            })?;
    }
    root.save(&rec)?;
    if let Some(p) = &opts.pid_file {
        write_pid_file(p, pid.as_raw())?;
    }
    Ok(rec)
}

/// Make container `id`'s `exec.fifo` and open it read-write (the open does
/// not wait for a writer, and the process's read then waits for `start`).
fn exec_fifo(root: &Root, id: &str) -> Result<OwnedFd> {
    let fifo_path = root.fifo(id);
    nestbox_sys::node::make_node(&fifo_path, nestbox_sys::node::NodeKind::Fifo, 0o622, 0, 0)
        .map_err(|e| OciError::sys(format!("mkfifo {}", fifo_path.display()), e))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fifo_path, std::fs::Permissions::from_mode(0o622))
            .map_err(|e| OciError::io("chmod", &fifo_path, e))?;
    }
    Ok(std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&fifo_path)
        .map_err(|e| OciError::io("open", &fifo_path, e))?
        .into())
}

/// The state JSON with `status` overridden, for hooks.
pub(crate) fn state_text(rec: &Record, status: &str) -> String {
    let mut v = state::state_json(rec, Status::Created);
    v["status"] = serde_json::Value::from(status);
    if status == "stopped" {
        v["pid"] = serde_json::Value::from(rec.pid);
    }
    v.to_string()
}

fn write_id_maps(pid: Pid, plan: &Plan) -> Result<()> {
    let text = |m: &[config::IdMapping]| {
        m.iter()
            .map(|r| format!("{} {} {}\n", r.inside, r.outside, r.size))
            .collect::<String>()
    };
    for (file, map) in [("uid_map", &plan.uid_map), ("gid_map", &plan.gid_map)] {
        let path = format!("/proc/{pid}/{file}");
        std::fs::write(&path, text(map)).map_err(|e| OciError::io("write", path, e))?;
    }
    Ok(())
}

/// Wait for the container's process to reach its hook point (`h`), or to
/// fail before (`1\tMESSAGE`).
fn wait_hook_point(report: &OwnedFd, id: &str) -> Result<()> {
    let mut byte = [0u8; 1];
    loop {
        match nix::unistd::read(report.as_raw_fd(), &mut byte) {
            Ok(1) if byte[0] == b'h' => return Ok(()),
            Ok(1) => {
                // A failure report: the rest of it follows.
                let mut rest = vec![byte[0]];
                let mut buf = [0u8; 1024];
                while let Ok(n @ 1..) = nix::unistd::read(report.as_raw_fd(), &mut buf) {
                    rest.extend_from_slice(&buf[..n]);
                }
                return Err(setup_error(&rest, id));
            }
            Ok(_) => return Err(setup_error(&[], id)),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(OciError::sys("read report pipe", e)),
        }
    }
}

/// The error of a failed set-up report (`1\tMESSAGE`, or nothing when the
/// process died without one).
fn setup_error(bytes: &[u8], id: &str) -> OciError {
    let text = String::from_utf8_lossy(bytes);
    let message = match text.strip_prefix("1\t") {
        Some(m) => m.to_string(),
        None => "the container's process exited during set-up".to_string(),
    };
    OciError::Setup {
        id: id.to_string(),
        message,
    }
}

/// Wait for the container's process to report: `0` ready, `1\tMESSAGE` failed.
fn wait_ready(report: &OwnedFd, id: &str) -> Result<()> {
    let mut bytes = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match nix::unistd::read(report.as_raw_fd(), &mut buf) {
            Ok(0) => break,
            Ok(n) => {
                bytes.extend_from_slice(&buf[..n]);
                if bytes == b"0" {
                    return Ok(());
                }
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(OciError::sys("read report pipe", e)),
        }
    }
    let text = String::from_utf8_lossy(&bytes);
    let message = match text.strip_prefix("1\t") {
        Some(m) => m.to_string(),
        None => "the container's process exited during set-up".to_string(),
    };
    Err(OciError::Setup {
        id: id.to_string(),
        message,
    })
}

/// Write `pid` to `path` atomically (a temporary file renamed over it).
pub fn write_pid_file(path: &Path, pid: i32) -> Result<()> {
    let path = std::path::absolute(path).map_err(|e| OciError::io("resolve", path, e))?;
    let tmp = path.with_file_name(format!(
        ".{}.tmp",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default()
    ));
    std::fs::write(&tmp, pid.to_string()).map_err(|e| OciError::io("write pid file", &tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| OciError::io("write pid file", &path, e))
}

/// Start created container `id`: its process execs the user's program.
pub fn start(root: &Root, id: &str) -> Result<()> {
    let rec = root.load(id)?;
    match root.status(&rec) {
        Status::Created => {}
        Status::Stopped => {
            return Err(wrong(
                id,
                Status::Stopped,
                "cannot start a stopped container",
            ))
        }
        s => {
            return Err(wrong(
                id,
                s,
                "cannot start a container that is already running",
            ))
        }
    }
    if rec.no_process {
        // Nothing to run: the container ends here, stopped.
        let _ = nestbox_sys::process::tgkill(rec.pid, rec.pid, libc::SIGKILL);
        let _ = std::fs::remove_file(root.fifo(id));
        return Err(wrong(
            id,
            Status::Created,
            "config.json has no process: nothing to start",
        ));
    }
    if let Some(link) = &rec.clone {
        // A clone's processes are the template's: its startContainer hooks
        // run from here (in the runtime's namespaces).
        hooks::run(
            "startContainer",
            &rec.hooks.start_container,
            &state_text(&rec, "created"),
        )?;
        crate::clone::start(root, &rec, link)?;
        hooks::run_warning(
            "poststart",
            &rec.hooks.poststart,
            &state_text(&rec, "running"),
        );
        return Ok(());
    }
    let fifo_path = root.fifo(id);
    // Write-only and non-blocking: refused (ENXIO) when no process holds
    // the fifo any more, i.e. the container's process is gone.
    let fifo = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&fifo_path);
    let written = fifo.and_then(|mut f| {
        use std::io::Write;
        f.write_all(b"0")
    });
    match written {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
            let _ = std::fs::remove_file(&fifo_path);
            return Err(wrong(
                id,
                Status::Stopped,
                "its process exited before start",
            ));
        }
        Err(e) => return Err(OciError::io("write exec fifo", &fifo_path, e)),
    }
    std::fs::remove_file(&fifo_path).map_err(|e| OciError::io("remove", &fifo_path, e))?;
    wait_for_exec(rec.pid);
    // The spec: a failed poststart hook is logged, the others and the
    // container go on.
    hooks::run_warning(
        "poststart",
        &rec.hooks.poststart,
        &state_text(&rec, "running"),
    );
    Ok(())
}

use std::os::unix::fs::OpenOptionsExt;

/// Wait (2 s at most) until process `pid` no longer runs the runtime's own
/// binary, i.e. it has exec'd its program (or exited), so that `start`
/// returns with the program running, as callers expect.
fn wait_for_exec(pid: i32) {
    use std::os::unix::fs::MetadataExt;
    let id = |p: &str| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    let ours = id("/proc/self/exe");
    let theirs = format!("/proc/{pid}/exe");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while ours.is_some() && id(&theirs) == ours && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
}

/// A wrong-state error.
pub fn wrong(id: &str, status: Status, why: &'static str) -> OciError {
    OciError::WrongState {
        id: id.to_string(),
        status: status.as_str(),
        why,
    }
}
