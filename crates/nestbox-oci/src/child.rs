//! The container's process between the fork and the `execve` of the user's
//! program: it waits for the runtime's go (id maps written, cgroup joined),
//! joins the namespaces given by path and makes the new ones, assembles the
//! root from the config's mounts and devices, pivots into it, masks paths,
//! sets sysctls, rlimits, the terminal, credentials, capabilities,
//! `no_new_privs` and seccomp, reports that it is ready, and then blocks on
//! the container's `exec.fifo` until `start` writes to it.
//!
//! Errors before the ready report go to the runtime over the report pipe as
//! `1\tMESSAGE`; the runtime then removes what it made. The process runs
//! single-threaded (forked from the single-threaded runtime), so it may run
//! ordinary Rust code.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use caps::{CapSet, CapsHashSet};
use nestbox_isolation::rootfs::{pivot_into, secure_join};
use nestbox_sys::mount::MsFlags;
use nestbox_sys::ns::Namespace;
use nix::sched::CloneFlags;

use crate::config::{Plan, ProcessPlan};
use crate::{OciError, Result};
use nestbox_isolation::rootfs::make_mountpoint;

/// Descriptors the container's process is given.
#[derive(Debug)]
pub struct ChildFds {
    /// The runtime writes one byte here when the process may go on.
    pub go: OwnedFd,
    /// Ready (`0`) or failure (`1\tMESSAGE`) reports to the runtime.
    pub report: OwnedFd,
    /// The console socket, when the process gets a terminal.
    pub console: Option<UnixStream>,
    /// `exec.fifo`, opened read-write (which never blocks), read until
    /// `start` writes to it; `None` to exec at once (`exec`).
    pub fifo: Option<OwnedFd>,
    /// `--preserve-fds N`: descriptors 3 to 3 + N - 1 reach the program.
    pub preserve_fds: u32,
    /// `restore` of a container started cold: the process is the *stub*
    /// that nestbox's checkpoint engine makes the image's pid 1. Set up as
    /// for `create` (namespaces, root, mounts, sysctls, rlimits, OOM score
    /// adjustment) but for what the image brings (session, credentials,
    /// capabilities, `no_new_privs`, seccomp: set by the engine), it reports
    /// ready and waits, blocked, for the runtime to take it over.
    pub restore_stub: bool,
}

/// The namespaces made at `clone` time: the pid namespace (the process must
/// be born in it) and a new user namespace (the runtime maps its ids before
/// the go). The others are unshared after the namespaces given by path were
/// joined, so they belong to the right user namespace.
pub fn clone_flags(plan: &Plan) -> CloneFlags {
    let mut f = CloneFlags::empty();
    if plan.new_namespace(Namespace::Pid) {
        f |= CloneFlags::CLONE_NEWPID;
    }
    if plan.new_namespace(Namespace::User) {
        f |= CloneFlags::CLONE_NEWUSER;
    }
    f
}

/// Body of the container's process. Never returns.
pub fn run(plan: &Plan, fds: ChildFds) -> ! {
    let report = fds.report.as_raw_fd();
    if fds.restore_stub {
        let err = match setup(plan, &fds).and_then(|_| stub_ready(plan, &fds)) {
            Ok(never) => match never {},
            Err(e) => e,
        };
        report_failure(report, &err)
    }
    if plan.process.is_none() {
        // No process: ready as it is, and nothing to start (`start` refuses
        // and kills this process).
        let err = match setup(plan, &fds) {
            Ok(_) => {
                let _ = nix::unistd::write(&fds.report, b"0");
                loop {
                    nix::unistd::pause();
                }
            }
            Err(e) => e,
        };
        report_failure(report, &err)
    }
    let err = match setup(plan, &fds).and_then(|(program, state)| {
        exec_with(
            &plan.process,
            &program,
            fds.fifo.as_ref(),
            plan.seccomp.as_ref(),
            Some(report),
            fds.preserve_fds,
            StartHooks {
                hooks: &plan.hooks.start_container,
                state: &state,
            },
        )
    }) {
        Ok(never) => match never {},
        Err(e) => e,
    };
    report_failure(report, &err)
}

/// The restore stub, set up: its OOM score adjustment (which the image does
/// not hold), then ready, then blocked until the runtime seizes it (ptrace)
/// and makes it the image's pid 1, or kills it.
fn stub_ready(plan: &Plan, fds: &ChildFds) -> Result<std::convert::Infallible> {
    if let Some(adj) = plan.process.oom_score_adj {
        let path = "/proc/self/oom_score_adj";
        std::fs::write(path, adj.to_string()).map_err(|e| OciError::io("write", path, e))?;
    }
    nix::unistd::write(&fds.report, b"0").map_err(|e| OciError::sys("write report pipe", e))?;
    loop {
        nix::unistd::pause();
    }
}

/// Report `err` on the report pipe and exit.
pub fn report_failure(report: RawFd, err: &OciError) -> ! {
    let line = format!("1\t{err}");
    // SAFETY: `report` is this process's own open descriptor until it exits.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(report) };
    // A runtime gone cannot be told; the exit code still says it failed.
    let _ = nix::unistd::write(fd, line.as_bytes());
    nestbox_sys::process::exit_now(1)
}

/// The hook point: the container's namespaces are made (and, with a mount
/// namespace, its mounts under the root, before the pivot). The process says
/// so (`h` on the report pipe); the runtime runs the `prestart` and
/// `createRuntime` hooks in its own namespaces and sends the container's
/// state JSON on the go pipe (then closes it); the process runs the
/// `createContainer` hooks here, in the container's namespaces, with their
/// paths resolved in the runtime's file system (the root is not pivoted
/// yet), as the runtime spec asks. Returns the state, which the
/// `startContainer` hooks get too.
fn hook_point(plan: &Plan, fds: &ChildFds) -> Result<String> {
    nix::unistd::write(&fds.report, b"h").map_err(|e| OciError::sys("write report pipe", e))?;
    let mut state = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match nix::unistd::read(fds.go.as_raw_fd(), &mut buf) {
            Ok(0) => break,
            Ok(n) => state.extend_from_slice(&buf[..n]),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(OciError::sys("read go pipe", e)),
        }
    }
    if state.is_empty() {
        // The runtime gave up (a createRuntime hook failed): it kills us.
        nestbox_sys::process::exit_now(1)
    }
    let state = String::from_utf8_lossy(&state).into_owned();
    crate::hooks::run("createContainer", &plan.hooks.create_container, &state)?;
    Ok(state)
}

fn setup(plan: &Plan, fds: &ChildFds) -> Result<(CString, String)> {
    let mut byte = [0u8; 1];
    match nix::unistd::read(fds.go.as_raw_fd(), &mut byte) {
        Ok(1) => {}
        _ => nestbox_sys::process::exit_now(1),
    }
    if plan.new_namespace(Namespace::User) {
        become_root().map_err(|e| OciError::sys("become root of the user namespace", e))?;
    }
    join_namespaces(plan)?;
    let mut unshare = CloneFlags::empty();
    for (kind, flag) in [
        (Namespace::Mnt, CloneFlags::CLONE_NEWNS),
        (Namespace::Uts, CloneFlags::CLONE_NEWUTS),
        (Namespace::Ipc, CloneFlags::CLONE_NEWIPC),
        (Namespace::Net, CloneFlags::CLONE_NEWNET),
        (Namespace::Cgroup, CloneFlags::CLONE_NEWCGROUP),
    ] {
        if plan.new_namespace(kind) {
            unshare |= flag;
        }
    }
    nix::sched::unshare(unshare).map_err(|e| OciError::sys(format!("unshare({unshare:?})"), e))?;
    if let Some(h) = &plan.hostname {
        nix::unistd::sethostname(h).map_err(|e| OciError::sys("sethostname", e))?;
    }
    if let Some(d) = &plan.domainname {
        set_domainname(d)?;
    }
    if plan.new_namespace(Namespace::Net) {
        nestbox_isolation::net::loopback_up()?;
    }
    let state;
    if plan.has_namespace(Namespace::Mnt) {
        prepare_root(plan)?;
        state = hook_point(plan, fds)?;
        pivot_into(&plan.rootfs)?;
    } else {
        state = hook_point(plan, fds)?;
        // No mount namespace: any mount would land on the host, so none is
        // made (config.rs refuses what needs one); the root is a chroot.
        nestbox_sys::mount::chroot(&plan.rootfs)
            .map_err(|e| OciError::sys(format!("chroot {}", plan.rootfs.display()), e))?;
        nix::unistd::chdir("/").map_err(|e| OciError::sys("chdir /", e))?;
    }
    // Before the masks: they may make /proc/sys read-only.
    for (key, value) in &plan.sysctl {
        let path = PathBuf::from("/proc/sys").join(key.replace('.', "/"));
        std::fs::write(&path, value).map_err(|e| OciError::io("write sysctl", path, e))?;
    }
    if plan.has_namespace(Namespace::Mnt) {
        finish_root(plan)?;
    }
    for &(res, soft, hard) in &plan.process.rlimits {
        nestbox_sys::process::set_rlimit(0, res, soft, hard)
            .map_err(|e| OciError::sys(format!("setrlimit({res}, {soft}, {hard})"), e))?;
    }
    if fds.restore_stub {
        // The session, terminal, program and credentials are the image's.
        return Ok((CString::default(), state));
    }
    nix::unistd::setsid().map_err(|e| OciError::sys("setsid", e))?;
    if plan.process.terminal {
        let socket = fds
            .console
            .as_ref()
            .ok_or_else(|| OciError::Usage("process.terminal needs --console-socket".into()))?;
        crate::console::attach(socket)?;
    }
    if plan.process.is_none() {
        return Ok((CString::default(), state));
    }
    Ok((find_program(&plan.process)?, state))
}

/// Take the ids of root in a freshly mapped user namespace.
fn become_root() -> nix::Result<()> {
    let (uid, gid) = (nix::unistd::Uid::from_raw(0), nix::unistd::Gid::from_raw(0));
    nix::unistd::setresgid(gid, gid, gid)?;
    nix::unistd::setresuid(uid, uid, uid)
}

/// Join the namespaces given by path (the pid namespace was joined by the
/// runtime before the fork), the user namespace first.
fn join_namespaces(plan: &Plan) -> Result<()> {
    for &kind in nestbox_isolation::namespaces::JOIN_ORDER {
        if kind == Namespace::Pid {
            continue;
        }
        let Some(path) = plan
            .namespaces
            .iter()
            .find(|n| n.kind == kind)
            .and_then(|n| n.path.as_ref())
        else {
            continue;
        };
        let file =
            std::fs::File::open(path).map_err(|e| OciError::io("open namespace", path, e))?;
        use std::os::fd::AsFd;
        nestbox_sys::ns::enter(file.as_fd(), kind)
            .map_err(|e| OciError::sys(format!("setns({}) {}", kind.name(), path.display()), e))?;
        if kind == Namespace::User {
            become_root()
                .map_err(|e| OciError::sys("become root of the joined user namespace", e))?;
        }
    }
    Ok(())
}

fn set_domainname(name: &str) -> Result<()> {
    let path = Path::new("/proc/sys/kernel/domainname");
    std::fs::write(path, name).map_err(|e| OciError::io("set domainname", path, e))
}

/// Mounts and devices under the root, before the pivot.
fn prepare_root(plan: &Plan) -> Result<()> {
    let root = &plan.rootfs;
    let slave = MsFlags::MS_SLAVE | MsFlags::MS_REC;
    nestbox_sys::mount::set_propagation(Path::new("/"), slave)
        .map_err(|e| OciError::sys("make / a slave mount", e))?;
    nestbox_sys::mount::bind(root, root, true)
        .map_err(|e| OciError::sys(format!("bind root {}", root.display()), e))?;
    for m in &plan.mounts {
        m.mount(root)?;
    }
    let dev = secure_join(root, Path::new("/dev"))?;
    let userns = plan.has_namespace(Namespace::User);
    // The devices every box gets are runc's default set too.
    for name in nestbox_isolation::dev::DEVICES {
        let target = dev.join(name);
        if plan
            .devices
            .iter()
            .any(|d| d.path == Path::new("/dev").join(name))
        {
            continue;
        }
        make_mountpoint(&target, false)?;
        nestbox_sys::mount::bind(&Path::new("/dev").join(name), &target, false)
            .map_err(|e| OciError::sys(format!("bind /dev/{name}"), e))?;
    }
    for d in &plan.devices {
        let target = secure_join(root, &d.path)?;
        if let Some(parent) = target.parent() {
            make_mountpoint(parent, true)?;
        }
        let _ = std::fs::remove_file(&target);
        if userns {
            // No device node can be made in a user namespace: bind the host's.
            make_mountpoint(&target, false)?;
            nestbox_sys::mount::bind(&d.path, &target, false)
                .map_err(|e| OciError::sys(format!("bind device {}", d.path.display()), e))?;
        } else {
            nestbox_sys::node::make_node(&target, d.kind, d.mode, d.major, d.minor)
                .map_err(|e| OciError::sys(format!("mknod {}", d.path.display()), e))?;
            std::os::unix::fs::chown(&target, Some(d.uid), Some(d.gid))
                .map_err(|e| OciError::io("chown", &target, e))?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(d.mode))
                .map_err(|e| OciError::io("chmod", &target, e))?;
        }
    }
    for &(link, to) in nestbox_isolation::dev::LINKS {
        let path = dev.join(link);
        if path.symlink_metadata().is_err() && dev.is_dir() {
            std::os::unix::fs::symlink(to, &path).map_err(|e| OciError::io("symlink", &path, e))?;
        }
    }
    let cwd = secure_join(root, &plan.process.cwd)?;
    if !cwd.exists() {
        make_mountpoint(&cwd, true)?;
    }
    Ok(())
}

/// After the pivot: root propagation, masked and read-only paths, a
/// read-only root.
fn finish_root(plan: &Plan) -> Result<()> {
    let root = Path::new("/");
    nestbox_sys::mount::set_propagation(root, plan.rootfs_propagation)
        .map_err(|e| OciError::sys("set the root's propagation", e))?;
    for path in &plan.masked_paths {
        let Ok(meta) = path.symlink_metadata() else {
            continue;
        };
        let r = if meta.is_dir() {
            nestbox_sys::mount::mount_fs("tmpfs", path, "tmpfs", MsFlags::MS_RDONLY, Some("size=0"))
        } else {
            nestbox_sys::mount::bind(Path::new("/dev/null"), path, false)
        };
        r.map_err(|e| OciError::sys(format!("mask {}", path.display()), e))?;
    }
    for path in &plan.readonly_paths {
        if path.symlink_metadata().is_err() {
            continue;
        }
        nestbox_sys::mount::bind(path, path, true)
            .map_err(|e| OciError::sys(format!("bind {}", path.display()), e))?;
        nestbox_isolation::mounts::remount_read_only(path)?;
    }
    if plan.root_readonly {
        nestbox_isolation::mounts::remount_read_only(root)?;
    }
    Ok(())
}

/// The program to exec: `args[0]`, searched in the process's `PATH` when it
/// has no slash, checked now so that `create` fails rather than `start`.
pub fn find_program(p: &ProcessPlan) -> Result<CString> {
    let name = &p.args[0];
    let executable = |path: &Path| {
        nix::unistd::access(path, nix::unistd::AccessFlags::X_OK).is_ok() && path.is_file()
    };
    let found = if name.contains('/') {
        let path = p.cwd.join(name);
        executable(&path).then_some(path)
    } else {
        let path_var = p
            .env
            .iter()
            .find_map(|e| e.strip_prefix("PATH="))
            .unwrap_or("/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
        path_var
            .split(':')
            .filter(|d| !d.is_empty())
            .map(|d| Path::new(d).join(name))
            .find(|p| executable(p))
    };
    let found = found.ok_or_else(|| {
        OciError::Usage(format!(
            "exec: {name:?}: executable file not found in $PATH or not executable"
        ))
    })?;
    cstring(found.to_string_lossy().as_ref())
}

fn cstring(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| OciError::Usage(format!("NUL byte in {s:?}")))
}

/// Credentials, capabilities, `no_new_privs`, seccomp, then wait for `start`
/// (when there is a fifo) and `execve`. `ready` (the report pipe) gets `0`
/// once everything that can fail before the wait is done; a failure after
/// that is printed on stderr and ends the process with 127. Descriptors 3
/// to 3 + `preserve_fds` - 1 are passed to the program; no other one is.
/// The `startContainer` hooks run once `start` came, right before the
/// `execve`, in the container (their paths resolved in its root).
#[allow(clippy::too_many_arguments)]
pub fn exec_with(
    p: &ProcessPlan,
    program: &CString,
    fifo: Option<&OwnedFd>,
    seccomp: Option<&nestbox_seccomp::Program>,
    ready: Option<RawFd>,
    preserve_fds: u32,
    start_hooks: StartHooks<'_>,
) -> Result<std::convert::Infallible> {
    let argv = p
        .args
        .iter()
        .map(|a| cstring(a))
        .collect::<Result<Vec<_>>>()?;
    let env = p
        .env
        .iter()
        .map(|a| cstring(a))
        .collect::<Result<Vec<_>>>()?;
    // Nothing the runtime had open may reach the program but the preserved
    // descriptors (checked open when the runtime started, so none of its
    // own is among them). Done first: a seccomp filter installed below may
    // not allow close_range.
    let first_closed = 3 + preserve_fds;
    nestbox_sys::fd::set_cloexec_range(first_closed, u32::MAX)
        .map_err(|e| OciError::sys("mark descriptors close-on-exec", e))?;
    for fd in 3..first_closed {
        // The caller passed them open; they may be close-on-exec in it.
        nix::fcntl::fcntl(
            fd as RawFd,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
        )
        .map_err(|e| OciError::sys(format!("--preserve-fds: descriptor {fd}"), e))?;
    }
    if let Some(adj) = p.oom_score_adj {
        let path = "/proc/self/oom_score_adj";
        std::fs::write(path, adj.to_string()).map_err(|e| OciError::io("write", path, e))?;
    }
    nix::unistd::chdir(&p.cwd)
        .map_err(|e| OciError::sys(format!("chdir {}", p.cwd.display()), e))?;
    // Without no_new_privs the filter must go in while the process still has
    // CAP_SYS_ADMIN; with it, as late as possible.
    if let (Some(f), false) = (seccomp, p.no_new_privileges) {
        f.install()
            .map_err(|e| OciError::Usage(format!("seccomp: {e}")))?;
    }
    set_credentials(p)?;
    if let Some(mask) = p.umask {
        nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(mask));
    }
    if p.no_new_privileges {
        nix::sys::prctl::set_no_new_privs().map_err(|e| OciError::sys("prctl(NO_NEW_PRIVS)", e))?;
    }
    if let Some(fd) = ready {
        // SAFETY: `fd` is the report pipe, open in this process until exec.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        // A runtime that went away will find the container stopped.
        let _ = nix::unistd::write(fd, b"0");
    }
    match wait_and_exec(
        program,
        &argv,
        &env,
        fifo,
        seccomp,
        p.no_new_privileges,
        start_hooks,
    ) {
        Err(e) if ready.is_some() => {
            eprintln!("nestbox-runc: {e}");
            nestbox_sys::process::exit_now(127)
        }
        other => other,
    }
}

/// The `startContainer` hooks and the state they read.
#[derive(Debug, Clone, Copy)]
pub struct StartHooks<'a> {
    /// The hooks (none for `exec`).
    pub hooks: &'a [crate::hooks::Hook],
    /// The container's state JSON.
    pub state: &'a str,
}

fn wait_and_exec(
    program: &CString,
    argv: &[CString],
    env: &[CString],
    fifo: Option<&OwnedFd>,
    seccomp: Option<&nestbox_seccomp::Program>,
    no_new_privileges: bool,
    start_hooks: StartHooks<'_>,
) -> Result<std::convert::Infallible> {
    if let Some(fifo) = fifo {
        let mut byte = [0u8; 1];
        loop {
            match nix::unistd::read(fifo.as_raw_fd(), &mut byte) {
                Ok(1) => break,
                Err(nix::errno::Errno::EINTR) => continue,
                Ok(_) => return Err(OciError::sys("read exec fifo", nix::errno::Errno::EIO)),
                Err(e) => return Err(OciError::sys("read exec fifo", e)),
            }
        }
    }
    crate::hooks::run("startContainer", start_hooks.hooks, start_hooks.state)?;
    if let (Some(f), true) = (seccomp, no_new_privileges) {
        f.install()
            .map_err(|e| OciError::Usage(format!("seccomp: {e}")))?;
    }
    nestbox_sys::process::reset_signal_dispositions();
    let e = match nix::unistd::execve(program, argv, env) {
        Err(e) => e,
        Ok(never) => match never {},
    };
    Err(OciError::sys(
        format!("exec {}", program.to_string_lossy()),
        e,
    ))
}

/// Groups, user, and the five capability sets.
fn set_credentials(p: &ProcessPlan) -> Result<()> {
    let fail = |what: &str| {
        OciError::sys(
            format!("set {what} capabilities"),
            nix::errno::Errno::last(),
        )
    };
    let bounding: CapsHashSet = p.caps.bounding.iter().copied().collect();
    for cap in caps::all() {
        if !bounding.contains(&cap) && caps::has_cap(None, CapSet::Bounding, cap).unwrap_or(false) {
            caps::drop(None, CapSet::Bounding, cap).map_err(|_| fail("bounding"))?;
        }
    }
    let groups: Vec<nix::unistd::Gid> = p
        .additional_gids
        .iter()
        .map(|g| nix::unistd::Gid::from_raw(*g))
        .collect();
    // setgroups is denied in a user namespace whose maps an unprivileged user
    // wrote: then only an empty list is expected, and skipping it is right.
    if let Err(e) = nix::unistd::setgroups(&groups) {
        if !(groups.is_empty() && e == nix::errno::Errno::EPERM) {
            return Err(OciError::sys("setgroups", e));
        }
    }
    nix::sys::prctl::set_keepcaps(true).map_err(|e| OciError::sys("prctl(KEEPCAPS)", e))?;
    let (uid, gid) = (
        nix::unistd::Uid::from_raw(p.uid),
        nix::unistd::Gid::from_raw(p.gid),
    );
    nix::unistd::setresgid(gid, gid, gid).map_err(|e| OciError::sys(format!("setgid {gid}"), e))?;
    nix::unistd::setresuid(uid, uid, uid).map_err(|e| OciError::sys(format!("setuid {uid}"), e))?;
    let set = |v: &[caps::Capability]| -> CapsHashSet { v.iter().copied().collect() };
    let permitted = set(&p.caps.permitted);
    let effective: CapsHashSet = set(&p.caps.effective);
    if !effective.is_subset(&permitted) {
        return Err(OciError::Unsupported(
            "process.capabilities: effective holds capabilities not in permitted".into(),
        ));
    }
    caps::set(None, CapSet::Effective, &effective).map_err(|_| fail("effective"))?;
    caps::set(None, CapSet::Inheritable, &set(&p.caps.inheritable))
        .map_err(|_| fail("inheritable"))?;
    caps::set(None, CapSet::Permitted, &permitted).map_err(|_| fail("permitted"))?;
    caps::clear(None, CapSet::Ambient).map_err(|_| fail("ambient"))?;
    for cap in &p.caps.ambient {
        caps::raise(None, CapSet::Ambient, *cap).map_err(|_| fail("ambient"))?;
    }
    nix::sys::prctl::set_keepcaps(false).map_err(|e| OciError::sys("prctl(KEEPCAPS)", e))?;
    Ok(())
}
