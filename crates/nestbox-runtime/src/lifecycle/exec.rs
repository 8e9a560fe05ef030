//! `exec`: run another command in a running box. The new process joins all of the
//! box's namespaces and its cgroup and gets the same user, capabilities,
//! no_new_privs and seccomp filter as the box's own command.
//!
//! The caller forks a helper that joins the cgroup and namespaces; joining a pid
//! namespace only applies to children, so the helper forks once more and the
//! grandchild, now inside the box, becomes the command. The helper passes the
//! command's exit status back.

use std::os::fd::AsRawFd;
use std::path::PathBuf;

use nestbox_isolation::namespaces::NamespaceHandles;
use nix::fcntl::OFlag;
use nix::sys::signal::{signal, SigHandler, Signal};
use nix::unistd::{fork, pipe2, ForkResult, Pid};

use crate::launch::{exec_command, read_report, CommandPlan};
use crate::registry::Registry;
use crate::spec::User;
use crate::state::Status;
use crate::{Result, RuntimeError};

/// What to run, and overrides of the box's settings for this process.
#[derive(Debug, Clone, Default)]
pub struct ExecOptions {
    /// Command and arguments.
    pub command: Vec<String>,
    /// Extra environment on top of the box's.
    pub env: Vec<String>,
    /// Working directory (default: the box's).
    pub workdir: Option<PathBuf>,
    /// User (default: the box's).
    pub user: Option<User>,
}

/// Run `opts.command` in the running box `name`; returns its exit code.
pub fn exec(reg: &Registry, name: &str, opts: &ExecOptions) -> Result<i32> {
    exec_inner(reg, name, opts).map_err(|e| e.in_box(name))
}

fn exec_inner(reg: &Registry, name: &str, opts: &ExecOptions) -> Result<i32> {
    if opts.command.is_empty() {
        return Err(RuntimeError::InvalidInput(
            "missing command: usage is nestbox exec BOX -- CMD [ARGS...]".into(),
        ));
    }
    let record = reg.load(name)?;
    let init = match (record.state.effective_status(), record.state.init) {
        (Status::Running, Some(init)) if init.alive() => init,
        _ => return Err(RuntimeError::NotRunning(name.to_string())),
    };
    let mut spec = record.spec.clone();
    spec.env.extend(opts.env.iter().cloned());
    spec.validate()?;
    // The box may end between the check above and here: its namespaces are then
    // gone, and that is "not running", not a failure.
    // (An exiting init loses its namespace links before it is a zombie: ENOENT.)
    let namespaces = NamespaceHandles::open(Pid::from_raw(init.pid)).map_err(|e| {
        if init.alive() && e.errno != nix::errno::Errno::ENOENT {
            RuntimeError::from(e)
        } else {
            RuntimeError::NotRunning(name.to_string())
        }
    })?;
    let setgroups = record.state.idmap.is_none_or(|m| m.allows_setgroups());
    let mut plan = CommandPlan::new(
        &opts.command,
        spec.environment(),
        opts.workdir.clone().unwrap_or(spec.workdir.clone()),
        opts.user.unwrap_or(spec.user),
        spec.capabilities.clone(),
        crate::monitor::seccomp_program(&spec, record.state.setns_cookie)?,
        setgroups,
        false,
    )?;
    plan.memory_merge = spec.ksm;
    let (rep_r, rep_w) = pipe2(OFlag::O_CLOEXEC).map_err(RuntimeError::sys("pipe2"))?;
    // While the command runs, a terminal's ^C reaches it directly; we only wait.
    ignore_interrupts();
    // SAFETY: the CLI is single-threaded, so the child may run arbitrary code.
    let helper = match unsafe { fork() }.map_err(RuntimeError::sys("fork"))? {
        ForkResult::Child => {
            drop(rep_r);
            helper_main(&record, &namespaces, &plan, rep_w.as_raw_fd())
        }
        ForkResult::Parent { child } => child,
    };
    drop(rep_w);
    let report = read_report(rep_r);
    let code = crate::process::wait_exit_code(helper);
    if let Some((code, message)) = report {
        // Joining failed because the box ended meanwhile (its cgroup removed,
        // its pid namespace without init: fork answers ENOMEM).
        if code == crate::error::EXIT_NESTBOX_ERROR
            && init.ends_within(std::time::Duration::from_secs(1))
        {
            return Err(RuntimeError::NotRunning(name.to_string()));
        }
        return Err(RuntimeError::Launch { code, message });
    }
    Ok(code)
}

/// The forked helper: join, fork the command, relay its status. Never returns.
fn helper_main(
    record: &crate::registry::BoxRecord,
    ns: &NamespaceHandles,
    plan: &CommandPlan,
    report: i32,
) -> ! {
    // It joins the box's mount namespace: no log path of the host applies.
    crate::diag::off();
    let fail = |msg: String| -> ! {
        // A caller gone cannot be told; the exit code 125 still says it failed.
        let _ = nix::unistd::write(
            // SAFETY: `report` stays open for the life of this process.
            unsafe { std::os::fd::BorrowedFd::borrow_raw(report) },
            format!("125\t{msg}").as_bytes(),
        );
        nestbox_sys::process::exit_now(125)
    };
    if let Some(cg) = &record.state.cgroup {
        if let Err(e) = cg.join_self() {
            fail(format!("join the box cgroup: {e}"));
        }
    }
    if let Err(e) = ns.join() {
        fail(format!("join the box namespaces: {e}"));
    }
    // SAFETY: single-threaded process (forked from the single-threaded CLI).
    match unsafe { fork() } {
        Err(e) => fail(format!("fork: {e}")),
        Ok(ForkResult::Child) => {
            // Fails only for an invalid signal, and SIGKILL is valid.
            let _ = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL);
            exec_command(plan, report)
        }
        Ok(ForkResult::Parent { child }) => {
            // SAFETY: closing our copy of the report pipe; the command keeps its own.
            unsafe { libc::close(report) };
            nestbox_sys::process::exit_now(crate::process::wait_exit_code(child))
        }
    }
}

fn ignore_interrupts() {
    for s in [Signal::SIGINT, Signal::SIGQUIT] {
        // SAFETY: SIG_IGN runs no handler code.
        // (signal fails only for SIGKILL/SIGSTOP, not these.)
        let _ = unsafe { signal(s, SigHandler::SigIgn) };
    }
}
