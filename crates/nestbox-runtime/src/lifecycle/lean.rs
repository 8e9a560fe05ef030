//! A fresh process image for the two processes every box keeps for its
//! whole life: its monitor and its init.
//!
//! Both are forks: a detached monitor of the nestbox command that started
//! the box (`run -d`, `clone -n`, a pool's refill), an init of its monitor.
//! A fork keeps every page of its parent's heap mapped, and once the parent
//! writes a page or exits, the child's copy is its own: an idle monitor held
//! about 240 KiB of private memory and its init about 200 KiB, nearly all of
//! it the heap of the command they were forked from (its parsed arguments,
//! help texts, the names of the other clones it made, JSON it wrote), which
//! neither ever reads. Their own state is a few descriptors and numbers.
//!
//! So, when the binary allows it ([`entry`] was called first thing in its
//! `main`), such a process replaces its image with a fresh one of the same
//! binary ([`nestbox_sys::process::exec_self`]) that receives exactly that
//! state and goes on where the old image stopped:
//!
//! * **A detached monitor**, once its box has been idle for
//!   [`crate::residency::IDLE_MS_BEFORE_DROP`] ([`become_lean_monitor`]):
//!   the box's identity, init's pid, the cgroup and the descriptors it
//!   watches (init's pidfd, the output pipes, the end pipe) go over a pipe
//!   as JSON; the new image loads the box's record, supervises the box as
//!   before and releases it when it ends. Run by root of the host, the
//!   renewal starts at idle priority (boxes made in a burst renew in the CPU
//!   time left over) and the new image goes back to the monitor's nice value
//!   once it has loaded the record. Blocked signals stay blocked and
//!   pending across `execve`, so none sent meanwhile is lost. A monitor with
//!   more than one thread (one serving an interposing monitor), or whose
//!   phases are traced, or still due to do delayed work, stays as it is.
//! * **The init of a clone's shell**, right after the shell is set up and
//!   before any process of the box exists ([`become_lean_init`]): its new
//!   image serves as the box's pid 1 ([`crate::init::adopt`]) from the start.
//!   No process of the box can see it between its `execve` and the moment it
//!   makes itself non-dumpable again, since none exists yet. Only a statically
//!   linked binary does this: a dynamic one would load the dynamic loader and
//!   the C library of the box's image.
//!
//! Either way a failure to `execve` leaves the process as it was, only
//! larger (a monitor logs why; an init has nowhere to). A fresh image's
//! start costs about a millisecond of CPU. The figures are in
//! `docs/clones.md`.

use std::ffi::{CStr, CString};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use nestbox_cgroup::BoxCgroup;
use nestbox_sys::process::Scheduling;
use nix::fcntl::{fcntl, FcntlArg, FdFlag};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use crate::monitor::Running;
use crate::paths::Roots;
use crate::registry::{BoxRecord, Registry};

/// The argument that makes [`entry`] continue a monitor.
const MONITOR_ARG: &str = "--nestbox-lean-monitor";
/// The argument that makes [`entry`] continue a clone shell's init.
const INIT_ARG: &str = "--nestbox-lean-init";
/// The lean monitor's thread name and first argument (`ps`).
pub const MONITOR_TITLE: &str = "nestbox-monitor";

/// Set by [`entry`]: the running binary continues lean processes.
static SUPPORTED: AtomicBool = AtomicBool::new(false);

/// Call first thing in the `main` of a binary that runs boxes: when this
/// process is the fresh image of a monitor or an init, go on as that
/// process (and never return); otherwise note that this binary can do it,
/// so that its monitors and inits may.
pub fn entry() {
    let mut args = std::env::args_os().skip(1);
    match args.next().as_ref().and_then(|a| a.to_str()) {
        Some(MONITOR_ARG) => continue_monitor(args.next().and_then(|a| a.to_str()?.parse().ok())),
        Some(INIT_ARG) => continue_init(args.next().and_then(|a| a.to_str()?.parse().ok())),
        _ => SUPPORTED.store(true, Ordering::Relaxed),
    }
}

/// Whether this process may replace its image: the binary continues lean
/// processes, and this process runs one thread (`execve` would end the
/// others) and traces no phases (their table is a mapping of this image).
fn may_renew() -> bool {
    SUPPORTED.load(Ordering::Relaxed)
        && !crate::phases::enabled()
        && crate::residency::single_threaded()
}

/// Whether this binary is linked statically: its program headers name no
/// program interpreter (`PT_INTERP`), so an `execve` of it loads no shared
/// library from wherever it runs. Inside a box that matters: the dynamic
/// loader and the C library would come from the box's image, which may not
/// hold them, hold other versions, or hold ones made to take over whatever
/// loads them.
fn statically_linked() -> bool {
    // SAFETY: getauxval only reads the auxiliary vector the kernel gave
    // this process; 0 means the entry is missing.
    let (phdr, phnum) = unsafe {
        (
            libc::getauxval(libc::AT_PHDR),
            libc::getauxval(libc::AT_PHNUM),
        )
    };
    if phdr == 0 || phnum == 0 {
        return false;
    }
    // SAFETY: AT_PHDR is the address of this executable's program header
    // table, mapped for the whole life of the process, with AT_PHNUM entries
    // of Elf64_Phdr.
    let headers =
        unsafe { std::slice::from_raw_parts(phdr as *const libc::Elf64_Phdr, phnum as usize) };
    !headers.iter().any(|h| h.p_type == libc::PT_INTERP)
}

/// What a monitor hands to its fresh image: the box, and the state of its
/// supervision (descriptors by number, kept open across `execve`).
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct MonitorHandoff {
    run: PathBuf,
    lib: PathBuf,
    id: String,
    name: String,
    init: i32,
    pidfd: RawFd,
    stdout: RawFd,
    stderr: RawFd,
    ended: RawFd,
    mount_ns: Option<RawFd>,
    cgroup: Option<BoxCgroup>,
    /// The monitor's nice value before the renewal (which runs at idle
    /// priority), or `None` if it ran at idle priority already.
    nice: Option<i32>,
}

/// Replace this detached monitor's image with a fresh one that supervises
/// the box of `record` from where `running` is (see the module's doc).
/// Returns only if it could not (the reason is logged unless it is that
/// this process may not), with everything as it was.
pub(crate) fn become_lean_monitor(reg: &Registry, record: &BoxRecord, running: &Running) {
    if !may_renew() || running.shell.is_some() {
        return;
    }
    let handoff = MonitorHandoff {
        run: reg.roots().run.clone(),
        lib: reg.roots().lib.clone(),
        id: record.state.id.clone(),
        name: record.name().to_string(),
        init: running.init.as_raw(),
        pidfd: running.pidfd.as_raw_fd(),
        stdout: running.stdout.as_raw_fd(),
        stderr: running.stderr.as_raw_fd(),
        ended: running.ended.as_raw_fd(),
        mount_ns: running.mount_ns.as_ref().map(|f| f.as_raw_fd()),
        cgroup: running.cgroup.clone(),
        nice: match nestbox_sys::process::scheduling() {
            Ok(Scheduling::Normal(n)) => Some(n),
            Ok(Scheduling::Idle) => None,
            Err(_) => Some(0),
        },
    };
    let kept: Vec<RawFd> = [handoff.pidfd, handoff.stdout, handoff.stderr, handoff.ended]
        .into_iter()
        .chain(handoff.mount_ns)
        .collect();
    if let Err(e) = renew_monitor(&handoff, &kept) {
        tracing::warn!(
            box_name = record.name(),
            "the idle monitor keeps its memory (no fresh image): {e}"
        );
        // The descriptors go back to close-on-exec (a failure leaves one
        // open in what this monitor starts later: harmless).
        let _ = keep_across_exec(&kept, false);
    }
}

/// Write `handoff` into a pipe and `execve` with its read end; an error
/// only if that failed.
fn renew_monitor(handoff: &MonitorHandoff, kept: &[RawFd]) -> Result<(), String> {
    let text = serde_json::to_vec(handoff).map_err(|e| e.to_string())?;
    // Far below a pipe's capacity (64 KiB): written whole without a reader.
    let (read, write) = nix::unistd::pipe().map_err(|e| format!("pipe: {e}"))?;
    std::fs::File::from(write)
        .write_all(&text)
        .map_err(|e| format!("writing the handoff: {e}"))?;
    keep_across_exec(kept, true).map_err(|e| format!("fcntl: {e}"))?;
    // The new image's start (loading the binary, the record) waits for idle
    // CPUs: many boxes made at once renew while the next are being made.
    // Only where the monitor may leave idle priority again (root of the
    // host: without CAP_SYS_NICE only RLIMIT_NICE would allow it). Failing
    // leaves the renewal at the monitor's own priority.
    let may_return =
        nix::unistd::geteuid().is_root() && !nestbox_isolation::idmap::in_user_namespace();
    if may_return && handoff.nice.is_some() {
        let _ = nestbox_sys::process::set_scheduling(Scheduling::Idle);
    }
    let fd = CString::new(read.as_raw_fd().to_string()).map_err(|e| e.to_string())?;
    let env: Vec<CString> = std::env::vars_os()
        .filter_map(|(k, v)| {
            let mut kv = k.into_encoded_bytes();
            kv.push(b'=');
            kv.extend(v.into_encoded_bytes());
            CString::new(kv).ok()
        })
        .collect();
    let env: Vec<&CStr> = env.iter().map(|e| e.as_c_str()).collect();
    let title = CString::new(MONITOR_TITLE).map_err(|e| e.to_string())?;
    let arg = CString::new(MONITOR_ARG).map_err(|e| e.to_string())?;
    let e = nestbox_sys::process::exec_self(&[&title, &arg, &fd], &env);
    back_to(handoff.nice);
    Err(format!("execve: {e}"))
}

/// Put this process back at nice `nice` (`None`: idle priority, as it was).
fn back_to(nice: Option<i32>) {
    if let Some(n) = nice {
        if let Err(e) = nestbox_sys::process::set_scheduling(Scheduling::Normal(n)) {
            // It relays output later than it should under load; nothing is lost.
            tracing::warn!("the renewed monitor stays at idle priority: {e}");
        }
    }
}

/// Clear (`keep`) or set close-on-exec on `fds`.
fn keep_across_exec(fds: &[RawFd], keep: bool) -> nix::Result<()> {
    let flag = if keep {
        FdFlag::empty()
    } else {
        FdFlag::FD_CLOEXEC
    };
    for &fd in fds {
        fcntl(fd, FcntlArg::F_SETFD(flag))?;
    }
    Ok(())
}

/// The fresh image of a monitor: read the handoff from descriptor `fd`,
/// supervise the box to its end, release it, and exit with its code.
fn continue_monitor(fd: Option<RawFd>) -> ! {
    set_thread_name(MONITOR_TITLE);
    crate::residency::one_malloc_arena();
    let Some(fd) = fd else {
        nestbox_sys::process::exit_now(crate::error::EXIT_NESTBOX_ERROR)
    };
    // SAFETY: the previous image passed this descriptor, the pipe's read end,
    // for this process alone.
    let mut pipe = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let mut text = Vec::new();
    let handoff = pipe
        .read_to_end(&mut text)
        .ok()
        .and_then(|_| serde_json::from_slice::<MonitorHandoff>(&text).ok());
    drop(pipe);
    let Some(h) = handoff else {
        // Nothing is known to log to: the box runs on unsupervised, and
        // reads `dead` (its monitor gone); `rm` removes it.
        nestbox_sys::process::exit_now(crate::error::EXIT_NESTBOX_ERROR)
    };
    let take = |fd: RawFd| {
        // SAFETY: handed over by the previous image, open across execve,
        // and owned by this process alone from now on.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        // Close-on-exec again (failing leaves it inherited by what this
        // process forks and execs: nothing does).
        let _ = fcntl(owned.as_raw_fd(), FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC));
        owned
    };
    let running = Running {
        init: Pid::from_raw(h.init),
        pidfd: take(h.pidfd),
        stdout: take(h.stdout).into(),
        stderr: take(h.stderr).into(),
        ended: take(h.ended).into(),
        reaped: std::cell::Cell::new(false),
        cgroup: h.cgroup,
        mount_ns: h.mount_ns.map(take),
        shell: None,
    };
    let reg = Registry::new(Roots {
        run: h.run,
        lib: h.lib,
    });
    // By name (one record read) unless it changed meanwhile (a pooled clone
    // claimed under another name): then by id, which reads every record.
    let record = reg
        .load(&h.name)
        .ok()
        .filter(|r| r.state.id == h.id)
        .map_or_else(|| reg.load_by_id(&h.id), Ok);
    let code = match record {
        Ok(record) => {
            crate::diag::to_file(record.monitor_log_path(), false);
            back_to(h.nice);
            supervise_to_the_end(&reg, &record, running)
        }
        Err(e) => {
            // The record went while the image was renewed (a racing `rm`,
            // which ends the box too): end what is left of it.
            back_to(h.nice);
            tracing::warn!(box_name = h.name.as_str(), "the box's record is gone: {e}");
            let _ = nix::sys::signal::kill(running.init, nix::sys::signal::Signal::SIGKILL);
            let code = running.reap().unwrap_or(crate::error::EXIT_NESTBOX_ERROR);
            if let Some(cg) = &running.cgroup {
                crate::diag::warn_on_err(Some(&h.name), "removing the cgroup", cg.remove());
            }
            code
        }
    };
    std::process::exit(code)
}

/// Supervise the running box of `record` until it ends and release it; its
/// exit code.
fn supervise_to_the_end(reg: &Registry, record: &BoxRecord, running: Running) -> i32 {
    let signals = match crate::monitor::block_forwarded_signals() {
        Ok(s) => s,
        Err(e) => {
            // Signals sent to the monitor are not forwarded (they stay
            // blocked); the box is supervised all the same.
            tracing::error!(box_name = record.name(), "{e}");
            match nix::sys::signalfd::SignalFd::with_flags(
                &nix::sys::signal::SigSet::empty(),
                nix::sys::signalfd::SfdFlags::SFD_CLOEXEC,
            ) {
                Ok(s) => s,
                Err(_) => return crate::error::EXIT_NESTBOX_ERROR,
            }
        }
    };
    match crate::monitor::supervise_then_finish(reg, record, running, signals, false, false) {
        Ok(o) => o.exit_code,
        Err(e) => {
            tracing::error!(box_name = record.name(), "{e}");
            e.exit_code()
        }
    }
}

/// Replace the image of a clone shell's init (before any other process of
/// the box exists) with a fresh one that serves as the box's init, its end
/// pipe `end`. Returns only if it could not.
pub(crate) fn become_lean_init(end: RawFd) {
    if !may_renew() || !statically_linked() {
        return;
    }
    let (Ok(title), Ok(arg), Ok(fd)) = (
        CString::new(crate::init::INIT_TITLE),
        CString::new(INIT_ARG),
        CString::new(end.to_string()),
    ) else {
        return;
    };
    if keep_across_exec(&[end], true).is_err() {
        return;
    }
    // No environment: nothing of the host's reaches the box's pid 1. Init
    // has nowhere to report a failure (its stdio is the box's log): it
    // serves from this image, its end pipe closed on exec again.
    let _ = nestbox_sys::process::exec_self(&[&title, &arg, &fd], &[]);
    let _ = keep_across_exec(&[end], false);
}

/// The fresh image of a clone shell's init.
fn continue_init(end: Option<RawFd>) -> ! {
    set_thread_name(crate::init::INIT_TITLE);
    let Some(end) = end else {
        nestbox_sys::process::exit_now(crate::error::EXIT_NESTBOX_ERROR)
    };
    // The end pipe is init's alone, closed in whatever it execs.
    // SAFETY: the previous image passed it open, for this process.
    let pipe = unsafe { std::os::fd::BorrowedFd::borrow_raw(end) };
    let _ = fcntl(end, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC));
    // `execve` clears the parent-death signal when the new credentials may
    // do more than the old (root's capabilities are recomputed): arm it
    // again, then make sure the monitor did not die in between. Its end of
    // the pipe is the only reader: without it the write end reports an
    // error.
    if nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).is_err()
        || monitor_gone(pipe)
    {
        nestbox_sys::process::exit_now(crate::error::EXIT_NESTBOX_ERROR)
    }
    crate::init::adopt_here(end)
}

/// Whether the pipe `end` writes to has no reader left (its monitor died).
fn monitor_gone(end: std::os::fd::BorrowedFd<'_>) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut fds = [PollFd::new(end, PollFlags::POLLOUT)];
    match poll(&mut fds, PollTimeout::ZERO) {
        Ok(_) => fds[0]
            .revents()
            .is_some_and(|r| r.contains(PollFlags::POLLERR)),
        Err(_) => false,
    }
}

/// Name this thread `name` (`execve` named it `exe`, after `/proc/self/exe`).
fn set_thread_name(name: &str) {
    if let Ok(name) = CString::new(name) {
        // Cosmetic; the names fit in the 16 bytes allowed.
        let _ = nix::sys::prctl::set_name(&name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handoff_reads_back_as_written() {
        let h = MonitorHandoff {
            run: "/r/run".into(),
            lib: "/r/lib".into(),
            id: "0123456789ab".into(),
            name: "c-1".into(),
            init: 4242,
            pidfd: 5,
            stdout: 6,
            stderr: 7,
            ended: 8,
            mount_ns: None,
            cgroup: None,
            nice: Some(0),
        };
        let text = serde_json::to_vec(&h).unwrap();
        assert_eq!(serde_json::from_slice::<MonitorHandoff>(&text).unwrap(), h);
    }

    #[test]
    fn a_binary_that_did_not_ask_never_renews_its_processes() {
        // The unit-test binary never calls `entry`: its monitors (run in
        // process by tests) must not exec the test binary.
        assert!(!may_renew());
    }

    #[test]
    fn a_test_binary_is_linked_dynamically_and_seen_so() {
        // Test binaries link the C library dynamically (only the release
        // build of `scripts/setup.sh` is static).
        assert!(!statically_linked());
    }

    #[test]
    fn a_pipe_without_its_reader_reads_as_a_monitor_gone() {
        let (r, w) = nix::unistd::pipe().unwrap();
        assert!(!monitor_gone(std::os::fd::AsFd::as_fd(&w)));
        drop(r);
        assert!(monitor_gone(std::os::fd::AsFd::as_fd(&w)));
    }
}
