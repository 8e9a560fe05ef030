//! The thread state of a template's processes, kept between forks.
//!
//! Each fork reads the state of every thread of the template process it forks
//! (registers, FPU/vector state, signal mask, alternate stack, rseq, robust
//! list, …: `nestbox_remote::ThreadState`), with ptrace requests and calls
//! injected into each thread: about 1 ms for a Node.js server's seven
//! threads. A template is frozen, and thawed only while its processes are
//! held under ptrace, so it runs no code of its own between two forks and its
//! threads' state stays what it was. The first fork of a template process
//! writes that state to the template's run directory
//! (`threads-PID.json`, with the process's start time); later forks, from
//! any process (`nestbox clone`, a pool's refill), take it from there
//! ([`nestbox_remote::Tracee::reuse_state`], which checks that it names the
//! very threads held) instead of reading the threads again.
//!
//! Best effort: a missing, unreadable or stale file (another process with
//! that pid, other threads) means the state is read again, and a file that
//! cannot be written is logged; the fork works either way.

use std::path::PathBuf;

use nestbox_remote::{ThreadState, Tracee};
use serde::{Deserialize, Serialize};

use crate::liveness::ProcRef;
use crate::registry::{BoxRecord, Registry};

/// What `threads-PID.json` holds.
#[derive(Serialize, Deserialize)]
struct Kept {
    /// The template process it was read from (pid and start time).
    process: ProcRef,
    /// Its leader's state, then its other threads'.
    leader: ThreadState,
    threads: Vec<ThreadState>,
}

fn file(reg: &Registry, template: &BoxRecord, pid: i32) -> PathBuf {
    reg.roots()
        .box_run(template.name())
        .join(format!("threads-{pid}.json"))
}

/// Give `tracee` (a process of `template`, stopped with all its threads) the
/// state a fork of an earlier stop kept, when there is one for this very
/// process; whether it took it.
pub(crate) fn reuse(reg: &Registry, template: &BoxRecord, tracee: &mut Tracee) -> bool {
    let pid = tracee.pid();
    let Ok(data) = std::fs::read(file(reg, template, pid)) else {
        return false;
    };
    let kept: Kept = match serde_json::from_slice(&data) {
        Ok(k) => k,
        Err(e) => {
            tracing::warn!(
                box_name = template.name(),
                "kept thread state of process {pid} is unreadable, read again: {e}"
            );
            return false;
        }
    };
    if ProcRef::of(pid) != Some(kept.process) {
        return false;
    }
    match tracee.reuse_state((kept.leader, kept.threads)) {
        Ok(taken) => taken,
        Err(e) => {
            tracing::warn!(
                box_name = template.name(),
                "kept thread state of process {pid} not used: {e}"
            );
            false
        }
    }
}

/// Keep the state a fork read from `tracee` (a process of `template`) for the
/// forks of its later stops.
pub(crate) fn keep(reg: &Registry, template: &BoxRecord, tracee: &Tracee) {
    let pid = tracee.pid();
    let (Some((leader, threads)), Some(process)) = (tracee.read_state(), ProcRef::of(pid)) else {
        return;
    };
    let kept = Kept {
        process,
        leader: leader.clone(),
        threads: threads.clone(),
    };
    let path = file(reg, template, pid);
    let written = serde_json::to_vec(&kept)
        .map_err(std::io::Error::other)
        .and_then(|data| {
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            // The template's registers: for root only.
            nestbox_sys::replace::replace_file_mode(&path, &tmp, &data, 0o600).map_err(|e| e.source)
        });
    if let Err(e) = written {
        tracing::warn!(
            box_name = template.name(),
            "keeping the thread state of process {pid} in {}: {e}",
            path.display()
        );
    }
}
