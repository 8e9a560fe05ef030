//! What happens inside a new box before its command runs, and how a command is
//! started in a box (shared by `run` and `exec`).
//!
//! The box's first process waits for its monitor's go-ahead (the monitor first
//! writes id maps and moves it into the box cgroup), enters a new cgroup
//! namespace, sets the hostname, assembles the root and pivots into it, then
//! forks the command and becomes the box's [`init`](crate::init).
//!
//! Errors before the command's `execve` are reported to the monitor over a
//! close-on-exec pipe as `CODE\tMESSAGE`; a successful exec closes the pipe.

use std::ffi::CString;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::PathBuf;

use nestbox_isolation::caps::{self, CapNames};
use nestbox_isolation::rootfs::{self, RootfsPlan};
use nestbox_seccomp::Program;
use nix::errno::Errno;
use nix::sched::{unshare, CloneFlags};
use nix::sys::signal::{sigprocmask, SigSet, SigmaskHow, Signal};
use nix::unistd::{ForkResult, Gid, Pid, Uid};

use crate::error::{EXIT_CANNOT_EXECUTE, EXIT_NESTBOX_ERROR, EXIT_NOT_FOUND};
use crate::spec::User;

/// How to start a command inside a box (already entered or being set up).
#[derive(Debug)]
pub struct CommandPlan {
    /// Program and arguments.
    pub argv: Vec<CString>,
    /// Complete environment.
    pub env: Vec<CString>,
    /// Directories of the box's PATH, searched when argv\[0\] has no slash.
    pub path_dirs: Vec<String>,
    /// Working directory (created if missing when `create_workdir`).
    pub workdir: PathBuf,
    /// Create the working directory if it does not exist.
    pub create_workdir: bool,
    /// User and group.
    pub user: User,
    /// Capability bounding set.
    pub caps: CapNames,
    /// Seccomp filter, if any.
    pub seccomp: Option<Program>,
    /// Whether `setgroups` is permitted (not in a user namespace mapped by a non-root user).
    pub setgroups: bool,
    /// Start a new session (for the box's main command; not for `exec`).
    pub new_session: bool,
    /// Mark the command's memory mergeable (`PR_SET_MEMORY_MERGE`, `--ksm`).
    pub memory_merge: bool,
    /// The monitor filter (`--monitor`) and its hand-over cookie: installed
    /// after the box's own filter, its listener sent to the box's monitor on
    /// [`INTERPOSE_FD`] (see `nestbox_seccomp::monitor_profile`).
    pub monitor_filter: Option<(Program, [u64; 2])>,
    /// A pipe to read one byte from before `execve` (a pooled shell's
    /// command waits there until its monitor has named the box on its
    /// network; end of file: the monitor gave up, the command fails).
    pub hold: Option<RawFd>,
}

impl CommandPlan {
    /// Build from strings; fails on interior NUL bytes.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        command: &[String],
        env: Vec<String>,
        workdir: PathBuf,
        user: User,
        caps: CapNames,
        seccomp: Option<Program>,
        setgroups: bool,
        new_session: bool,
    ) -> crate::Result<Self> {
        let cstr = |s: &String| {
            CString::new(s.as_bytes()).map_err(|_| {
                crate::RuntimeError::InvalidInput(format!(
                    "argument or variable contains a NUL byte: {s:?}"
                ))
            })
        };
        let path_dirs = env
            .iter()
            .find_map(|e| e.strip_prefix("PATH="))
            .unwrap_or(crate::spec::DEFAULT_PATH)
            .split(':')
            .filter(|d| !d.is_empty())
            .map(String::from)
            .collect();
        Ok(CommandPlan {
            argv: command.iter().map(cstr).collect::<crate::Result<_>>()?,
            env: env.iter().map(cstr).collect::<crate::Result<_>>()?,
            path_dirs,
            workdir,
            create_workdir: new_session,
            user,
            caps,
            seccomp,
            setgroups,
            new_session,
            memory_merge: false,
            monitor_filter: None,
            hold: None,
        })
    }
}

/// Everything the box's first process needs, prepared by the monitor before the fork.
#[derive(Debug)]
pub struct LaunchPlan {
    /// The root to assemble.
    pub rootfs: RootfsPlan,
    /// Hostname of the box.
    pub hostname: String,
    /// Files to write `0` to, moving the process into the box cgroup (see
    /// `BoxCgroup::self_join_files`); empty when the box has no cgroup.
    pub cgroup_join: Vec<PathBuf>,
    /// Files to write `0` to once the box's cgroup namespace is made, moving
    /// the process on into the cgroup its processes live in: the cgroup v2
    /// leaf of a box whose cgroups are delegated to it (`--nest`; see
    /// `BoxCgroup::ns_root_join_files`). Empty otherwise.
    pub cgroup_leaf: Vec<PathBuf>,
    /// The box has its own network namespace (bring its loopback up).
    pub own_network: bool,
    /// Set the hostname, bring loopback up and assemble the root before
    /// waiting for the go (while the monitor makes the cgroup) rather than
    /// after joining the cgroup. Not for a user-namespace box, which needs its
    /// id maps (written by the monitor before the go) to mount.
    pub assemble_before_go: bool,
    /// Whether `setgroups` is permitted in the box (see [`CommandPlan::setgroups`]).
    pub setgroups: bool,
    /// The command; `None` for a clone shell, whose init adopts the process that
    /// nestbox forks into it from a template, and for a pooled box shell.
    pub command: Option<CommandPlan>,
    /// A pooled box shell (see [`crate::lifecycle::shell`]): once its root is
    /// assembled, its init waits on [`ChildFds::shell`] for the command of the
    /// box that claims it.
    pub shell: bool,
}

/// File descriptors the box's first process is given.
#[derive(Debug)]
pub struct ChildFds {
    /// Becomes the command's stdin.
    pub stdin: OwnedFd,
    /// Becomes stdout.
    pub stdout: OwnedFd,
    /// Becomes stderr.
    pub stderr: OwnedFd,
    /// The monitor writes one byte here when the child may proceed.
    pub go: OwnedFd,
    /// Error reports to the monitor (close-on-exec).
    pub report: OwnedFd,
    /// With monitors: where the command sends the monitor filter's listener.
    pub interpose: Option<OwnedFd>,
    /// A pooled shell: where its init receives the claiming box's command
    /// (never together with `interpose`: a box with monitors is not pooled).
    pub shell: Option<OwnedFd>,
    /// Where init says the box has ended (see [`crate::init`]).
    pub ended: OwnedFd,
}

/// Body of the box's first process (pid 1 of the new pid namespace). Never returns.
pub fn box_first_process(plan: &LaunchPlan, fds: ChildFds) -> ! {
    // The monitor's log path means nothing in the box's mount namespace.
    crate::diag::off();
    crate::phases::mark("box: first process runs");
    match setup_box(plan, fds) {
        Ok(Ready::Command(command)) => {
            // The command holds its own copy until exec; init must not keep the pipe open.
            // SAFETY: REPORT_FD is this process's own descriptor, never used
            // again; so is INTERPOSE_FD, which the box has only with monitors.
            unsafe {
                libc::close(REPORT_FD);
                if plan
                    .command
                    .as_ref()
                    .is_some_and(|c| c.monitor_filter.is_some())
                {
                    libc::close(INTERPOSE_FD);
                }
            }
            crate::init::run(command, END_FD)
        }
        Ok(Ready::Adopt) => {
            // SAFETY: REPORT_FD is this process's own descriptor, never used again.
            unsafe { libc::close(REPORT_FD) };
            crate::init::adopt(END_FD)
        }
        Ok(Ready::Shell) => {
            crate::init::leave_idle_priority();
            // The command's process is forked now, not when the shell is
            // claimed: it waits on the channel, init serves it from now on.
            // SAFETY: this process is single-threaded (a fork of the
            // single-threaded monitor), so the child may run arbitrary code.
            match unsafe { nix::unistd::fork() } {
                Err(e) => fail(REPORT_FD, EXIT_NESTBOX_ERROR, &format!("fork: {e}")),
                Ok(ForkResult::Child) => {
                    // Closing the report pipe in both processes tells the
                    // monitor the shell is ready.
                    // SAFETY: REPORT_FD and END_FD are this process's own
                    // descriptors, never used again (END_FD is init's).
                    unsafe {
                        libc::close(REPORT_FD);
                        libc::close(END_FD);
                    }
                    crate::init::wait_for_command(SHELL_FD)
                }
                Ok(ForkResult::Parent { child }) => {
                    // SAFETY: both are this process's own descriptors, never
                    // used again (the channel is the command process's now).
                    unsafe {
                        libc::close(REPORT_FD);
                        libc::close(SHELL_FD);
                    }
                    crate::init::run(child, END_FD)
                }
            }
        }
        Err((code, message)) => fail(REPORT_FD, code, &message),
    }
}

type Failure = (i32, String);

/// What the box's first process does once its root is in place.
enum Ready {
    /// Serve as init of the command it forked (this pid).
    Command(Pid),
    /// A clone shell: adopt the process forked into it.
    Adopt,
    /// A pooled box shell: wait for a command.
    Shell,
}

/// A failure of nestbox itself (exit code 125): what failed, and why.
fn e125(what: &str, e: &dyn std::fmt::Display) -> Failure {
    (EXIT_NESTBOX_ERROR, format!("{what}: {e}"))
}

/// Where the go pipe and the report pipe end up in the box's first process.
const GO_FD: RawFd = 3;
const REPORT_FD: RawFd = 4;
/// Where the monitors' hand-over socket ends up (when the box has monitors).
const INTERPOSE_FD: RawFd = 5;
/// Where a pooled shell's channel to its monitor ends up (a shell has no
/// monitors, so the descriptor is free).
const SHELL_FD: RawFd = 5;
/// Where init's pipe to the monitor for the box's end ends up.
const END_FD: RawFd = 6;

/// Put stdio on 0-2, the go and report pipes on 3 and 4, the monitors' or
/// the shell's socket on 5, the end pipe on 6, and close every other
/// descriptor: init never execs, so close-on-exec alone would let it keep the
/// caller's descriptors (a detached CLI's ready pipe, a test harness's pipes...)
/// open for the whole life of the box.
fn keep_only_box_fds(fds: ChildFds) -> nix::Result<(RawFd, RawFd)> {
    use nix::fcntl::{fcntl, FcntlArg};
    // Move the pipes out of the way first so the dup2s below cannot clobber them.
    let go = fcntl(fds.go.as_raw_fd(), FcntlArg::F_DUPFD_CLOEXEC(16))?;
    let report = fcntl(fds.report.as_raw_fd(), FcntlArg::F_DUPFD_CLOEXEC(16))?;
    let interpose = fds
        .interpose
        .as_ref()
        .or(fds.shell.as_ref())
        .map(|f| fcntl(f.as_raw_fd(), FcntlArg::F_DUPFD_CLOEXEC(16)))
        .transpose()?;
    let ended = fcntl(fds.ended.as_raw_fd(), FcntlArg::F_DUPFD_CLOEXEC(16))?;
    for (fd, target) in [(&fds.stdin, 0), (&fds.stdout, 1), (&fds.stderr, 2)] {
        nix::unistd::dup2(fd.as_raw_fd(), target)?;
    }
    nix::unistd::dup3(go, GO_FD, nix::fcntl::OFlag::O_CLOEXEC)?;
    nix::unistd::dup3(report, REPORT_FD, nix::fcntl::OFlag::O_CLOEXEC)?;
    nix::unistd::dup3(ended, END_FD, nix::fcntl::OFlag::O_CLOEXEC)?;
    std::mem::forget(fds);
    match interpose {
        Some(i) => {
            nix::unistd::dup3(i, INTERPOSE_FD, nix::fcntl::OFlag::O_CLOEXEC)?;
        }
        // SAFETY: whatever was inherited on 5 (the pipes kept were moved
        // above 16 first) is owned by no object used again.
        None => unsafe { nestbox_sys::fd::close_range(INTERPOSE_FD as u32, INTERPOSE_FD as u32) }?,
    }
    // SAFETY: everything this child still needs lives on 0-6 (the ChildFds
    // were forgotten above); no object owning a higher descriptor is used
    // again.
    unsafe { nestbox_sys::fd::close_range(END_FD as u32 + 1, u32::MAX) }?;
    Ok((GO_FD, REPORT_FD))
}

fn setup_box(plan: &LaunchPlan, fds: ChildFds) -> Result<Ready, Failure> {
    // Die with the monitor. Had it died before this took effect, the go pipe below
    // reads end-of-file and the child leaves.
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(|e| e125("prctl(PDEATHSIG)", &e))?;
    let (go, _) = keep_only_box_fds(fds).map_err(|e| e125("set up descriptors", &e))?;
    if plan.assemble_before_go {
        prepare_root(plan)?;
    }
    crate::phases::mark("box: waiting for go");
    let mut byte = [0u8; 1];
    match nix::unistd::read(go, &mut byte) {
        Ok(1) => {}
        // The monitor gave up on the box (or died): leave quietly.
        _ => nestbox_sys::process::exit_now(EXIT_NESTBOX_ERROR),
    }
    // SAFETY: `go` is this process's own descriptor and is not used again.
    unsafe { libc::close(go) };
    crate::phases::mark("box: go received");
    // Join the box cgroup by moving ourselves (still host root, single-threaded):
    // the cheap path, see BoxCgroup::self_join_files.
    for file in &plan.cgroup_join {
        std::fs::write(file, "0")
            .map_err(|e| e125(&format!("join cgroup {}", file.display()), &e))?;
    }
    if plan.rootfs.userns {
        become_namespace_root(plan.setgroups)
            .map_err(|e| e125("become root of the user namespace", &e))?;
        // Changing credentials cleared the parent-death signal: arm it again,
        // then make sure the monitor did not die in between (it holds the
        // report pipe's read end until the command runs).
        nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)
            .map_err(|e| e125("prctl(PDEATHSIG)", &e))?;
        if monitor_gone(REPORT_FD) {
            nestbox_sys::process::exit_now(EXIT_NESTBOX_ERROR);
        }
    }
    crate::phases::mark("box: joined cgroup");
    unshare(CloneFlags::CLONE_NEWCGROUP).map_err(|e| e125("unshare(cgroup namespace)", &e))?;
    // A delegated box's cgroup namespace is rooted at its cgroup (the parent
    // of the boxes it starts); its processes live in the leaf below.
    for file in &plan.cgroup_leaf {
        std::fs::write(file, "0")
            .map_err(|e| e125(&format!("join cgroup {}", file.display()), &e))?;
    }
    crate::phases::mark("box: cgroup namespace");
    if !plan.assemble_before_go {
        prepare_root(plan)?;
    }
    rootfs::pivot_into(&plan.rootfs.mountpoint).map_err(|e| e125("box root", &e))?;
    crate::phases::mark("box: pivoted");
    // Block every signal before forking, so init sees each one through its signalfd.
    sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::all()), None)
        .map_err(|e| e125("sigprocmask", &e))?;
    if plan.shell {
        return Ok(Ready::Shell);
    }
    let Some(command) = &plan.command else {
        return Ok(Ready::Adopt);
    };
    // SAFETY: this process is single-threaded (a fresh fork of the single-threaded
    // monitor), so the child may run arbitrary code.
    match unsafe { nix::unistd::fork() }.map_err(|e| e125("fork", &e))? {
        ForkResult::Child => exec_command(command, REPORT_FD),
        ForkResult::Parent { child } => {
            crate::phases::mark("box: command forked");
            Ok(Ready::Command(child))
        }
    }
}

/// Whether the reader of the pipe whose write end is `fd` is gone (the
/// monitor died): `poll` reports an error on the write end then.
fn monitor_gone(fd: RawFd) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    // SAFETY: `fd` is this process's own open descriptor for the call.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let mut fds = [PollFd::new(fd, PollFlags::empty())];
    matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
        && fds[0]
            .revents()
            .is_some_and(|r| r.intersects(PollFlags::POLLERR | PollFlags::POLLHUP))
}

/// Hostname, loopback and the box root, assembled in the box's own mount
/// namespace (none of it depends on the box's cgroup).
fn prepare_root(plan: &LaunchPlan) -> Result<(), Failure> {
    nix::unistd::sethostname(&plan.hostname).map_err(|e| e125("sethostname", &e))?;
    if plan.own_network {
        nestbox_isolation::net::loopback_up().map_err(|e| e125("network", &e))?;
    }
    crate::phases::mark("box: hostname, loopback");
    let assembled = rootfs::assemble(&plan.rootfs).map_err(|e| e125("box root", &e));
    crate::phases::mark("box: root assembled");
    assembled
}

/// Take the ids of root in the (freshly mapped) user namespace, so files the box
/// creates belong to its mapped root rather than to an unmapped host id.
fn become_namespace_root(setgroups: bool) -> nix::Result<()> {
    if setgroups {
        nix::unistd::setgroups(&[])?;
    }
    let (uid, gid) = (Uid::from_raw(0), Gid::from_raw(0));
    nix::unistd::setresgid(gid, gid, gid)?;
    nix::unistd::setresuid(uid, uid, uid)
}

/// Turn the calling process into the command: session, signals, fds, working
/// directory, credentials, capabilities, no_new_privs, seccomp, then execve.
/// On failure reports `CODE\tMESSAGE` on `report` and exits with CODE.
pub fn exec_command(plan: &CommandPlan, report: RawFd) -> ! {
    crate::phases::mark("command: forked");
    let err = match prepare_credentials(plan)
        .inspect(|()| crate::phases::mark("command: credentials, seccomp"))
        .and_then(|()| wait_for_hold(plan))
    {
        Ok(()) => {
            crate::phases::mark("command: let go; execve");
            exec_path_search(plan)
        }
        Err(e) => e,
    };
    fail(report, err.0, &err.1)
}

fn prepare_credentials(plan: &CommandPlan) -> Result<(), Failure> {
    if plan.new_session {
        nix::unistd::setsid().map_err(|e| e125("setsid", &e))?;
    }
    nestbox_sys::process::reset_signal_dispositions();
    // Nothing the caller had open may leak into the box.
    nestbox_sys::fd::set_cloexec_range(3, u32::MAX)
        .map_err(|e| e125("mark descriptors close-on-exec", &e))?;
    if plan.create_workdir && !plan.workdir.exists() {
        std::fs::create_dir_all(&plan.workdir).map_err(|e| {
            e125(
                &format!("create working directory {}", plan.workdir.display()),
                &e,
            )
        })?;
    }
    nix::unistd::chdir(&plan.workdir).map_err(|e| {
        e125(
            &format!("working directory {} in the box", plan.workdir.display()),
            &e.desc(),
        )
    })?;
    caps::restrict_bounding(&plan.caps).map_err(|e| e125("capabilities", &e))?;
    if plan.setgroups {
        nix::unistd::setgroups(&[]).map_err(|e| e125("setgroups", &e))?;
    }
    let (uid, gid) = (Uid::from_raw(plan.user.uid), Gid::from_raw(plan.user.gid));
    nix::unistd::setresgid(gid, gid, gid).map_err(|e| e125(&format!("setgid {gid}"), &e))?;
    nix::unistd::setresuid(uid, uid, uid).map_err(|e| e125(&format!("setuid {uid}"), &e))?;
    caps::apply_process_sets(&plan.caps, plan.user.uid == 0)
        .map_err(|e| e125("capabilities", &e))?;
    nix::sys::prctl::set_no_new_privs().map_err(|e| e125("prctl(NO_NEW_PRIVS)", &e))?;
    if plan.memory_merge {
        crate::ksm::make_process_mergeable().map_err(|e| e125("prctl(PR_SET_MEMORY_MERGE)", &e))?;
    }
    // The monitor filter first: installing the box's own filter after it
    // does not depend on that filter allowing seccomp(2) (the stricter
    // answer of the two wins whatever their order).
    if let Some((filter, cookie)) = &plan.monitor_filter {
        let listener = filter
            .install_with_listener()
            .map_err(|e| e125("seccomp (monitors)", &e))?;
        // The one call the filter lets through unanswered (the cookie): the
        // monitor is not listening yet.
        nestbox_sys::seccomp_notify::send_listener(
            INTERPOSE_FD,
            std::os::fd::AsRawFd::as_raw_fd(&listener),
            *cookie,
        )
        .map_err(|e| e125("hand the monitors their listener", &e))?;
        drop(listener);
        // SAFETY: INTERPOSE_FD is this process's own descriptor, not used again.
        unsafe { libc::close(INTERPOSE_FD) };
    }
    if let Some(filter) = &plan.seccomp {
        filter.install().map_err(|e| e125("seccomp", &e))?;
    }
    Ok(())
}

/// Wait for the go-ahead on [`CommandPlan::hold`], if any.
fn wait_for_hold(plan: &CommandPlan) -> Result<(), Failure> {
    let Some(fd) = plan.hold else {
        return Ok(());
    };
    // SAFETY: `fd` is this process's own descriptor (given by init), open
    // until the exec closes it.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let mut byte = [0u8; 1];
    loop {
        match nix::unistd::read(fd.as_raw_fd(), &mut byte) {
            Ok(1) => return Ok(()),
            Err(Errno::EINTR) => continue,
            _ => {
                return Err((
                    EXIT_NESTBOX_ERROR,
                    "the box's monitor gave up before its command ran".into(),
                ))
            }
        }
    }
}

/// execve argv\[0\], searching PATH when it has no slash; returns the failure.
fn exec_path_search(plan: &CommandPlan) -> Failure {
    let prog = plan.argv[0].to_bytes();
    let name = String::from_utf8_lossy(prog).to_string();
    let candidates: Vec<CString> = if prog.contains(&b'/') {
        vec![plan.argv[0].clone()]
    } else {
        plan.path_dirs
            .iter()
            .filter_map(|d| CString::new(format!("{d}/{name}")).ok())
            .collect()
    };
    let mut denied: Option<Errno> = None;
    for path in &candidates {
        let e = match nix::unistd::execve(path, &plan.argv, &plan.env) {
            Err(e) => e,
            Ok(never) => match never {},
        };
        match e {
            Errno::ENOENT | Errno::ENOTDIR => continue,
            other => {
                denied = Some(other);
                if !matches!(other, Errno::EACCES) {
                    break;
                }
            }
        }
    }
    match denied {
        None => (
            EXIT_NOT_FOUND,
            format!("command not found in the box: {name}"),
        ),
        Some(e) => (
            EXIT_CANNOT_EXECUTE,
            format!("cannot execute {name} in the box: {}", e.desc()),
        ),
    }
}

/// Report a failure to the monitor and exit with its code.
fn fail(report: RawFd, code: i32, message: &str) -> ! {
    let line = format!("{code}\t{message}");
    // SAFETY: `report` is a valid open fd owned by this process until exit.
    let fd = unsafe { BorrowedFd::borrow_raw(report) };
    // A monitor gone cannot be told; the exit code still says it failed.
    let _ = nix::unistd::write(fd, line.as_bytes());
    nestbox_sys::process::exit_now(code)
}

/// Read a failure report (`CODE\tMESSAGE`) until EOF; `None` when the pipe closed
/// silently (the command's exec succeeded).
pub fn read_report(report: impl std::os::fd::AsFd) -> Option<(i32, String)> {
    let mut bytes = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        match nix::unistd::read(report.as_fd().as_raw_fd(), &mut buf) {
            Ok(0) => break,
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&bytes).into_owned();
    if text.is_empty() {
        return None;
    }
    let (code, msg) = text.split_once('\t').unwrap_or(("125", text.as_str()));
    Some((code.parse().unwrap_or(EXIT_NESTBOX_ERROR), msg.to_string()))
}
