//! The operations on an existing container: `state`, `list`, `kill`,
//! `delete`, `ps`, `pause`, `resume`, `events --stats`, `update` and `exec`.

use std::os::fd::{AsFd, AsRawFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use nestbox_sys::ns::Namespace;
use nix::sys::signal::Signal;
use nix::unistd::Pid;

use crate::child;
use crate::config;
use crate::create::{write_pid_file, wrong};
use crate::state::{self, Record, Root, Status};
use crate::{hooks, OciError, Result};

/// The state JSON of container `id`.
pub fn state(root: &Root, id: &str) -> Result<serde_json::Value> {
    let rec = root.load(id)?;
    Ok(state::state_json(&rec, root.status(&rec)))
}

/// Parse a signal as runc does: a name with or without `SIG`, or a number.
pub fn parse_signal(s: &str) -> Result<i32> {
    if let Ok(n) = s.parse::<i32>() {
        if (1..=64).contains(&n) {
            return Ok(n);
        }
    } else {
        let upper = s.to_ascii_uppercase();
        let name = if upper.starts_with("SIG") {
            upper
        } else {
            format!("SIG{upper}")
        };
        if let Ok(sig) = name.parse::<Signal>() {
            return Ok(sig as i32);
        }
    }
    Err(OciError::Usage(format!("unknown signal {s:?}")))
}

/// Send `signal` to the container's process (to every process of its
/// cgroup with `all`).
pub fn kill(root: &Root, id: &str, signal: i32, all: bool) -> Result<()> {
    let rec = root.load(id)?;
    let status = root.status(&rec);
    if status == Status::Stopped && !all {
        return Err(wrong(id, status, "container not running"));
    }
    let send = |pid: i32| nestbox_sys::process::tgkill(pid, pid, signal);
    if all {
        if let Some(cg) = &rec.cgroup {
            for pid in cg.procs()? {
                // A process that exited meanwhile needs no signal.
                let _ = send(pid);
            }
        }
        return Ok(());
    }
    // A clone: its process, not the monitor the caller waits on.
    let target = rec.clone.as_ref().map_or(rec.pid, |c| c.process);
    send(target).map_err(|e| OciError::sys(format!("kill container {id:?}"), e))
}

/// Delete container `id`: refused unless it is stopped, or `force` (which
/// kills it). Its cgroup and record go; `poststop` hooks run.
pub fn delete(root: &Root, id: &str, force: bool) -> Result<()> {
    let rec = match root.load(id) {
        Err(OciError::NotFound(_)) if force => return Ok(()),
        other => other?,
    };
    let status = root.status(&rec);
    if status != Status::Stopped {
        if !force {
            return Err(wrong(
                id,
                status,
                "cannot delete a container that is not stopped (use --force)",
            ));
        }
        stop_now(&rec)?;
    }
    remove(root, &rec)
}

/// Kill every process of the container and wait until its process is gone.
fn stop_now(rec: &Record) -> Result<()> {
    if let Some(link) = &rec.clone {
        // The box goes with everything in it; its monitor then exits.
        return crate::clone::remove(link);
    }
    if let Some(cg) = &rec.cgroup {
        cg.kill_all()?;
    } else {
        let _ = nestbox_sys::process::tgkill(rec.pid, rec.pid, libc::SIGKILL);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while state::alive(rec.pid, rec.start_time) {
        if Instant::now() >= deadline {
            // Ten seconds after SIGKILL: the process hangs in the kernel.
            return Err(OciError::sys(
                format!("stop container {:?}", rec.id),
                nix::errno::Errno::ETIMEDOUT,
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

fn remove(root: &Root, rec: &Record) -> Result<()> {
    if let Some(link) = &rec.clone {
        crate::clone::remove(link)?;
    } else if let Some(cg) = &rec.cgroup {
        cg.kill_all()?;
        cg.remove()?;
    }
    let dir = root.container_dir(&rec.id);
    std::fs::remove_dir_all(&dir).map_err(|e| OciError::io("remove", &dir, e))?;
    let mut v = state::state_json(rec, Status::Stopped);
    v["pid"] = serde_json::Value::from(rec.pid);
    // The spec: a failed poststop hook is logged, the others run and the
    // deletion stands.
    hooks::run_warning("poststop", &rec.hooks.poststop, &v.to_string());
    Ok(())
}

/// The processes of the container (host pids).
pub fn ps(root: &Root, id: &str) -> Result<Vec<i32>> {
    let rec = root.load(id)?;
    match &rec.cgroup {
        Some(cg) => Ok(cg.procs()?),
        None => Ok(Vec::new()),
    }
}

/// Freeze (`true`) or thaw the container.
pub fn set_paused(root: &Root, id: &str, pause: bool) -> Result<()> {
    let rec = root.load(id)?;
    let status = root.status(&rec);
    let cg = rec
        .cgroup
        .as_ref()
        .ok_or_else(|| OciError::Usage(format!("container {id:?} has no cgroup")))?;
    match (pause, status) {
        (true, Status::Running) => Ok(cg.freeze()?),
        (false, Status::Paused) => Ok(cg.thaw()?),
        (true, s) => Err(wrong(id, s, "only a running container can be paused")),
        (false, s) => Err(wrong(id, s, "only a paused container can be resumed")),
    }
}

/// One `events --stats` object, in runc's shape (the fields nestbox measures).
pub fn stats(root: &Root, id: &str) -> Result<serde_json::Value> {
    let rec = root.load(id)?;
    let cg = rec
        .cgroup
        .as_ref()
        .ok_or_else(|| OciError::Usage(format!("container {id:?} has no cgroup")))?;
    let s = cg.stats()?;
    Ok(serde_json::json!({
        "type": "stats",
        "id": id,
        "data": {
            "cpu": { "usage": { "total": s.cpu_usage_ns } },
            "memory": {
                "usage": { "usage": s.memory_current, "max": s.memory_peak },
                "oom_kill": s.oom_kills,
            },
            "pids": { "current": s.pids_current },
        }
    }))
}

/// Change the resources of a running (or created or paused) container:
/// `resources` is a `linux.resources` object (what `update --resources`
/// reads); only the limits it sets are written.
pub fn update(root: &Root, id: &str, resources: &serde_json::Value) -> Result<()> {
    let rec = root.load(id)?;
    let status = root.status(&rec);
    if status == Status::Stopped {
        return Err(wrong(id, status, "cannot update a stopped container"));
    }
    let r: oci_spec::runtime::LinuxResources = serde_json::from_value(resources.clone())
        .map_err(|e| OciError::Usage(format!("update: resources: {e}")))?;
    let limits = crate::resources::limits(Some(&r))?;
    let cg = rec
        .cgroup
        .as_ref()
        .ok_or_else(|| OciError::Usage(format!("container {id:?} has no cgroup")))?;
    Ok(cg.update(&limits)?)
}

/// Options of `exec`.
#[derive(Debug, Clone, Default)]
pub struct ExecOpts {
    /// A process.json replacing the config's process.
    pub process: Option<PathBuf>,
    /// Program and arguments (when no `process` file).
    pub args: Vec<String>,
    /// Extra environment.
    pub env: Vec<String>,
    /// Working directory.
    pub cwd: Option<PathBuf>,
    /// `uid[:gid]`.
    pub user: Option<String>,
    /// Allocate a terminal.
    pub tty: bool,
    /// Console socket for the terminal.
    pub console_socket: Option<PathBuf>,
    /// Pid file.
    pub pid_file: Option<PathBuf>,
    /// Return once started.
    pub detach: bool,
    /// Set no_new_privs.
    pub no_new_privs: bool,
    /// `--preserve-fds N`: descriptors 3 to 3 + N - 1 reach the program.
    pub preserve_fds: u32,
    /// `--cap`: capabilities added to the bounding, effective and permitted
    /// sets of the process (as runc does).
    pub caps: Vec<String>,
}

/// Run a new process in container `id`; its exit code, or 0 when detached.
pub fn exec(root: &Root, id: &str, opts: &ExecOpts) -> Result<i32> {
    let rec = root.load(id)?;
    let status = root.status(&rec);
    if matches!(status, Status::Stopped | Status::Paused) {
        return Err(wrong(
            id,
            status,
            "cannot exec in a container that is not running",
        ));
    }
    let plan = config::load(&rec.bundle)?;
    let mut p = match &opts.process {
        Some(path) => {
            let proc: oci_spec::runtime::Process = std::fs::read_to_string(path)
                .map_err(|e| OciError::io("read", path, e))
                .and_then(|t| {
                    serde_json::from_str(&t).map_err(|e| OciError::Config {
                        path: path.clone(),
                        message: e.to_string(),
                    })
                })?;
            config::process_plan(&proc).map_err(|e| match e {
                OciError::Unsupported(message) => OciError::Config {
                    path: path.clone(),
                    message,
                },
                other => other,
            })?
        }
        None => {
            if opts.args.is_empty() {
                return Err(OciError::Usage("exec needs a command or --process".into()));
            }
            let mut p = plan.process.clone();
            p.args = opts.args.clone();
            p.terminal = opts.tty;
            p
        }
    };
    p.env.extend(opts.env.iter().cloned());
    if let Some(cwd) = &opts.cwd {
        p.cwd = cwd.clone();
    }
    if let Some(user) = &opts.user {
        let (u, g) = user.split_once(':').unwrap_or((user, "0"));
        let num = |s: &str| {
            s.parse::<u32>()
                .map_err(|_| OciError::Usage(format!("--user {user:?}: expected UID[:GID]")))
        };
        p.uid = num(u)?;
        p.gid = num(g)?;
    }
    p.no_new_privileges |= opts.no_new_privs;
    for name in &opts.caps {
        let upper = name.to_ascii_uppercase();
        let full = if upper.starts_with("CAP_") {
            upper
        } else {
            format!("CAP_{upper}")
        };
        let cap: caps::Capability = full.parse().map_err(|_| {
            OciError::Usage(format!(
                "exec --cap {name}: not a capability this kernel interface knows"
            ))
        })?;
        for set in [
            &mut p.caps.bounding,
            &mut p.caps.effective,
            &mut p.caps.permitted,
        ] {
            if !set.contains(&cap) {
                set.push(cap);
                set.sort_by_key(|c| c.index());
            }
        }
    }
    if p.terminal != opts.console_socket.is_some() {
        return Err(OciError::Usage(
            "a terminal (--tty or process.terminal) and --console-socket go together".into(),
        ));
    }
    let console = match &opts.console_socket {
        Some(path) => Some(crate::console::connect(path)?),
        None => None,
    };
    // A clone's namespaces are its process's (its record's pid is its monitor).
    let target = rec.clone.as_ref().map_or(rec.pid, |c| c.process);
    let handles = nestbox_isolation::namespaces::NamespaceHandles::open(Pid::from_raw(target))?;
    let pid_ns = std::fs::File::open(format!("/proc/{target}/ns/pid"))
        .map_err(|e| OciError::io("open namespace", format!("/proc/{target}/ns/pid"), e))?;
    // Joining the pid namespace changes only where children are born.
    nestbox_sys::ns::enter(pid_ns.as_fd(), Namespace::Pid)
        .map_err(|e| OciError::sys(format!("setns(pid) of container {id:?}"), e))?;
    let join_files = rec
        .cgroup
        .as_ref()
        .map(|c| c.self_join_files())
        .unwrap_or_default();
    let (rep_r, rep_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| OciError::sys("pipe2", e))?;
    // SAFETY: the runtime is single-threaded and no flag is given.
    let forked =
        unsafe { nestbox_isolation::namespaces::fork_into(nix::sched::CloneFlags::empty()) }?;
    let pid = match forked {
        nestbox_sys::process::Forked::Child => {
            drop(rep_r);
            let err = match exec_child(
                &join_files,
                &handles,
                &p,
                &plan,
                console.as_ref(),
                opts.preserve_fds,
            ) {
                Ok(never) => match never {},
                Err(e) => e,
            };
            child::report_failure(rep_w.as_raw_fd(), &err)
        }
        nestbox_sys::process::Forked::Parent(pid) => pid,
    };
    drop(rep_w);
    drop(console);
    let mut bytes = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match nix::unistd::read(rep_r.as_raw_fd(), &mut buf) {
            Ok(0) => break,
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => break,
        }
    }
    if !bytes.is_empty() {
        let _ = nix::sys::wait::waitpid(pid, None);
        let text = String::from_utf8_lossy(&bytes);
        return Err(OciError::Setup {
            id: id.to_string(),
            message: format!("exec: {}", text.strip_prefix("1\t").unwrap_or(&text)),
        });
    }
    if let Some(path) = &opts.pid_file {
        write_pid_file(path, pid.as_raw())?;
    }
    if opts.detach {
        return Ok(0);
    }
    Ok(wait_exit_code(pid))
}

/// Body of the exec'd process: cgroup, namespaces, then as the container's.
fn exec_child(
    join_files: &[PathBuf],
    handles: &nestbox_isolation::namespaces::NamespaceHandles,
    p: &config::ProcessPlan,
    plan: &config::Plan,
    console: Option<&std::os::unix::net::UnixStream>,
    preserve_fds: u32,
) -> Result<std::convert::Infallible> {
    for file in join_files {
        std::fs::write(file, "0").map_err(|e| OciError::io("join cgroup", file, e))?;
    }
    handles.join()?;
    for &(res, soft, hard) in &p.rlimits {
        nestbox_sys::process::set_rlimit(0, res, soft, hard)
            .map_err(|e| OciError::sys(format!("setrlimit({res}, {soft}, {hard})"), e))?;
    }
    nix::unistd::setsid().map_err(|e| OciError::sys("setsid", e))?;
    if let Some(socket) = console {
        crate::console::attach(socket)?;
    }
    let program = child::find_program(p)?;
    child::exec_with(
        p,
        &program,
        None,
        plan.seccomp.as_ref(),
        None,
        preserve_fds,
        child::StartHooks {
            hooks: &[],
            state: "",
        },
    )
}

/// Wait for `pid` (a child) and give its exit code as a shell would: the
/// status, or 128 + the signal that killed it.
pub fn wait_exit_code(pid: Pid) -> i32 {
    use nix::sys::wait::{waitpid, WaitStatus};
    loop {
        match waitpid(pid, None) {
            Ok(WaitStatus::Exited(_, code)) => return code,
            Ok(WaitStatus::Signaled(_, sig, _)) => return 128 + sig as i32,
            Ok(_) | Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return 255,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_parse_as_runc_parses_them() {
        assert_eq!(parse_signal("KILL").unwrap(), libc::SIGKILL);
        assert_eq!(parse_signal("SIGTERM").unwrap(), libc::SIGTERM);
        assert_eq!(parse_signal("usr1").unwrap(), libc::SIGUSR1);
        assert_eq!(parse_signal("9").unwrap(), 9);
        assert_eq!(parse_signal("34").unwrap(), 34);
        for bad in ["0", "65", "SIGFOO", ""] {
            assert!(parse_signal(bad).is_err(), "{bad}");
        }
    }
}
