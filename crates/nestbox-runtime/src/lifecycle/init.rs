//! The box's pid 1: forwards every signal it receives to the command, reaps
//! orphaned processes, and exits with the command's status (128+N when the command
//! was killed by signal N). When it exits, the kernel kills whatever else is left
//! in the box's pid namespace.
//!
//! Before it exits, init kills and waits out every other process of the box
//! itself and then tells the monitor the box has ended, with the code, on the
//! end pipe: the monitor answers a waiting `run` on that, without waiting for
//! init's own exit (the kernel's teardown of its address space and
//! namespaces, and the wake-up that follows), and reaps init before it
//! releases the box.
//!
//! It keeps only CAP_KILL (to signal a command running as another user) and marks
//! itself non-dumpable, so processes in the box can neither ptrace it nor read its
//! memory.

use std::os::fd::{BorrowedFd, RawFd};

use nix::errno::Errno;
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

/// Run as init until `command` exits, then exit with its status, said first
/// on `end` (the monitor's end pipe).
/// All signals must already be blocked (they are read through a signalfd).
pub fn run(command: Pid, end: RawFd) -> ! {
    crate::process::stdio_to_dev_null();
    serve(command, end)
}

/// The pid a clone's process has in its clone shell: the first process created in
/// the shell's fresh pid namespace after init itself (init forks nothing).
pub const ADOPTED_PID: i32 = 2;

/// Init of a clone shell: wait for the process nestbox forks into the shell from a
/// template (re-parented here as pid [`ADOPTED_PID`]), then serve it as its command.
/// Standard output and error stay open: they are the clone's log pipes, which
/// nestbox hands to the clone's process.
pub fn adopt(end: RawFd) -> ! {
    // Nothing of the box runs yet: the moment to take a fresh image, which
    // does not keep the monitor's heap (see `lean`). Returns if it may not.
    crate::lifecycle::lean::become_lean_init(end);
    adopt_here(end)
}

/// [`adopt`], in this process image as it is.
pub(crate) fn adopt_here(end: RawFd) -> ! {
    serve(Pid::from_raw(ADOPTED_PID), end)
}

/// Leave the idle priority a pooled shell is made at (a pool refill): the
/// box it becomes must not keep it. Called by a shell's first process before
/// it forks the command's process, so both leave it.
pub fn leave_idle_priority() {
    // Failing leaves the shell at idle priority: slower, not wrong.
    let _ = nestbox_sys::process::set_scheduling(nestbox_sys::process::Scheduling::Normal(0));
}

/// The command's process of a pooled box shell (see
/// [`crate::lifecycle::shell`]), forked by the shell's init as soon as the
/// shell is ready, so that a claim waits for no fork: wait on `channel` for
/// the command of the box that claims the shell, then start it as a cold
/// box's command starts (hostname, then the command's own preparation and
/// `execve`, failures on the report pipe that comes with the message). The
/// end of the channel (the monitor tore the shell down, or died) ends this
/// process, and with it the shell (its init serves this process as the
/// box's command).
pub fn wait_for_command(channel: std::os::fd::RawFd) -> ! {
    use std::os::fd::{AsRawFd, BorrowedFd};
    let _ = nix::sys::prctl::set_dumpable(false);
    set_process_title(SHELL_COMMAND_TITLE);
    // SAFETY: `channel` is this process's own descriptor (placed by the
    // launch), open until the command's execve closes it.
    let sock = unsafe { BorrowedFd::borrow_raw(channel) };
    // This process keeps its pages while it waits (see `shell::serve`):
    // faulting them back in would be paid by the claim.
    let received = crate::lifecycle::shell::wire::recv::<crate::lifecycle::shell::wire::Go>(sock);
    let Ok(Some((go, mut fds))) = received else {
        nestbox_sys::process::exit_now(crate::error::EXIT_NESTBOX_ERROR)
    };
    if fds.is_empty() {
        nestbox_sys::process::exit_now(crate::error::EXIT_NESTBOX_ERROR)
    }
    let report = fds.remove(0);
    let stdin = if go.stdin && !fds.is_empty() {
        Some(fds.remove(0))
    } else {
        None
    };
    if go.phases && !fds.is_empty() {
        // Closed by the command's execve (close-on-exec).
        crate::phases::to_fd(std::os::fd::IntoRawFd::into_raw_fd(fds.remove(0)));
    }
    let hold = if go.hold && !fds.is_empty() {
        Some(fds.remove(0))
    } else {
        None
    };
    crate::phases::mark("shell command: go received");
    let fail = |code: i32, message: String| -> ! {
        let line = format!("{code}\t{message}");
        // A monitor gone cannot be told; the exit code still says it failed.
        let _ = nix::unistd::write(&report, line.as_bytes());
        nestbox_sys::process::exit_now(code)
    };
    if let Err(e) = nix::unistd::sethostname(&go.spec.hostname) {
        fail(
            crate::error::EXIT_NESTBOX_ERROR,
            format!("sethostname: {e}"),
        )
    }
    let mut plan = match crate::monitor::command_plan(&go.spec, go.cookie, None) {
        Ok(p) => p,
        Err(e) => fail(e.exit_code(), e.to_string()),
    };
    plan.hold = hold.as_ref().map(|h| h.as_raw_fd());
    // What a cold box's first process inherits from its `run`: this one
    // takes it from the `run` that claimed it.
    go.inherited.apply();
    crate::phases::mark("shell command: hostname set, command planned");
    if let Some(stdin) = &stdin {
        if let Err(e) = nix::unistd::dup2(stdin.as_raw_fd(), 0) {
            fail(crate::error::EXIT_NESTBOX_ERROR, format!("stdin: {e}"))
        }
    }
    // The descriptors left (`report`, `hold`, `stdin`'s original, the
    // channel) are close-on-exec, or made so by the command's preparation.
    crate::launch::exec_command(&plan, report.as_raw_fd())
}

fn serve(command: Pid, end: RawFd) -> ! {
    // Init has nowhere to report (its stdio is /dev/null and no log path
    // applies in the box), so its ignored results carry their reason here.
    // PR_SET_DUMPABLE with 0 fails only for an invalid argument, never here.
    let _ = nix::sys::prctl::set_dumpable(false);
    set_process_title(INIT_TITLE);
    keep_only_kill_capability();
    let Ok(sfd) = SignalFd::with_flags(&SigSet::all(), SfdFlags::SFD_CLOEXEC) else {
        // Without a signalfd init cannot see signals: just wait for the command.
        end_box(crate::process::wait_exit_code(command), end)
    };
    let mut dropped_file_pages = false;
    loop {
        if !dropped_file_pages {
            use std::os::fd::AsFd;
            let mut fds = [nix::poll::PollFd::new(
                sfd.as_fd(),
                nix::poll::PollFlags::POLLIN,
            )];
            let timeout = nix::poll::PollTimeout::from(crate::residency::IDLE_MS_BEFORE_DROP);
            if nix::poll::poll(&mut fds, timeout).unwrap_or(1) == 0 {
                crate::residency::drop_idle_memory();
                dropped_file_pages = true;
                continue;
            }
        }
        // A missed read only delays reaping until the next signal.
        if let Ok(Some(info)) = sfd.read_signal() {
            let sig = Signal::try_from(info.ssi_signo as i32).ok();
            match sig {
                Some(Signal::SIGCHLD) => {
                    if let Some(code) = reap(command) {
                        crate::phases::mark("init: command reaped");
                        linger_for_clones(&sfd);
                        end_box(code, end);
                    }
                }
                Some(s) => {
                    // ESRCH: the command is exiting; its end comes as SIGCHLD.
                    let _ = kill(command, s);
                }
                None => {}
            }
        }
    }
}

/// A template's clones live in pid namespaces nested in the template's: were this
/// init to exit, the kernel would kill them all. So while any process of a nested
/// pid namespace exists, keep reaping and wait (checking twice a second).
fn linger_for_clones(sfd: &SignalFd) {
    use std::os::fd::AsFd;
    while nested_namespace_processes() {
        let mut fds = [nix::poll::PollFd::new(
            sfd.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        if nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(500u16)).unwrap_or(0) > 0 {
            // Draining the signal only wakes the loop; reaping every child
            // (pid 0: none in particular) returns nothing we need.
            let _ = sfd.read_signal();
            let _ = reap(Pid::from_raw(0));
        }
    }
}

/// Whether a process of a pid namespace nested in this one is alive (its `NSpid`
/// line in /proc lists more than one pid).
fn nested_namespace_processes() -> bool {
    crate::process::proc_pid_dirs()
        .any(|dir| crate::process::ns_pids(&dir).is_some_and(|p| p.len() > 1))
}

/// Reap every exited child; the command's exit code once it is among them.
fn reap(command: Pid) -> Option<i32> {
    let mut result = None;
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(_) => return result,
            Ok(status) => {
                if status.pid() == Some(command) {
                    if let Some(code) = crate::process::exit_code(status) {
                        result = Some(code);
                    }
                }
            }
        }
    }
}

/// End the box with `code`: kill and reap every other process of it (as
/// the kernel would at init's exit), tell the monitor on `end` once none is
/// left, and exit.
fn end_box(code: i32, end: RawFd) -> ! {
    if nix::unistd::getpid().as_raw() != 1 {
        // Never so (a box has its own pid namespace); were it, -1 would
        // reach far beyond the box.
        nestbox_sys::process::exit_now(code)
    }
    // Every process of the pid namespace but init (pid 1 is spared by -1).
    let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
    // Until ECHILD: no child left.
    while let Ok(_) | Err(Errno::EINTR) = waitpid(None, None) {}
    // A process entered from outside (`nestbox exec`) is not init's child:
    // its parent reaps it. Said only once the box's /proc lists init alone;
    // else init's exit, on the monitor's pidfd, says it (the kernel waits
    // for every process of the namespace before init is gone).
    let deadline = std::time::Instant::now() + END_WAIT;
    while crate::process::proc_pid_dirs().nth(1).is_some() {
        if std::time::Instant::now() >= deadline {
            crate::phases::mark("init: exits");
            nestbox_sys::process::exit_now(code)
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    crate::phases::mark("init: box ended, exits");
    // SAFETY: `end` is this process's own descriptor (placed by the launch),
    // open for its whole life.
    let end = unsafe { BorrowedFd::borrow_raw(end) };
    // A monitor gone reads nothing; init's exit says the same.
    let _ = nix::unistd::write(end, &code.to_le_bytes());
    nestbox_sys::process::exit_now(code)
}

/// How long init waits for processes of the box that are not its children
/// (killed, and reaped by their parents outside) before it exits without
/// telling the monitor first.
const END_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// How init shows up in the box's `ps`.
pub const INIT_TITLE: &str = "nestbox-init";
/// How a pooled shell's command process shows up until its command runs
/// (the shell's monitor shows up as `nestbox-shell`).
pub const SHELL_COMMAND_TITLE: &str = "nestbox-command";

/// Replace the command line inherited from the nestbox CLI (which names host
/// paths such as the state root) with `title`, in place, and set the thread name.
pub(crate) fn set_process_title(title: &str) {
    // Cosmetic (the thread name in ps); the title fits, so it cannot fail.
    let _ = nix::sys::prctl::set_name(&std::ffi::CString::new(title).unwrap_or_default());
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return;
    };
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
        return;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // arg_start and arg_end are fields 48 and 49 of the stat line (index 45/46 after ')').
    let (Some(start), Some(end)) = (
        fields.get(45).and_then(|f| f.parse::<usize>().ok()),
        fields.get(46).and_then(|f| f.parse::<usize>().ok()),
    ) else {
        return;
    };
    if end <= start || title.len() >= end - start {
        return;
    }
    // SAFETY: [arg_start, arg_end) is this process's own argv string area, mapped
    // writable on its stack; it is only overwritten with bytes and stays within bounds.
    unsafe {
        let area = std::slice::from_raw_parts_mut(start as *mut u8, end - start);
        area.fill(0);
        area[..title.len()].copy_from_slice(title.as_bytes());
    }
}

fn keep_only_kill_capability() {
    use nestbox_isolation::caps::{apply_process_sets, restrict_bounding, CapNames};
    let keep: CapNames = ["CAP_KILL".to_string()].into_iter().collect();
    // Best effort: failing to shed capabilities leaves init as privileged as before.
    let _ = restrict_bounding(&keep).and_then(|()| apply_process_sets(&keep, true));
}
