//! Typed errors of remote fork: each names the process, and where it applies the
//! syscall, the fd or the path involved.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Result alias of this crate.
pub type Result<T, E = RemoteError> = std::result::Result<T, E>;

/// Everything that can go wrong while attaching to, inspecting or forking a process.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The process does not exist (any more).
    #[error("process {pid} does not exist")]
    NoSuchProcess {
        /// Host pid.
        pid: i32,
    },
    /// `PTRACE_SEIZE` failed because another tracer is attached.
    #[error("the template (pid {pid}) is already being traced by PID {tracer}")]
    AlreadyTraced {
        /// Host pid of the template.
        pid: i32,
        /// Host pid of the tracer, from `/proc/PID/status`.
        tracer: i32,
    },
    /// The template's main thread has exited while other threads run on (a
    /// zombie leader): its state (registers, pid) is gone.
    #[error("process {pid} cannot be forked: its main thread has exited ({threads} threads left)")]
    ZombieLeader {
        /// Host pid.
        pid: i32,
        /// Number of threads (the exited leader included).
        threads: usize,
    },
    /// The template runs 32-bit code (only x86_64 processes are supported).
    #[error("process {pid} is not running 64-bit code (cs = {cs:#x})")]
    Not64Bit {
        /// Host pid.
        pid: i32,
        /// Its code segment selector.
        cs: u64,
    },
    /// A ptrace request or a wait on a tracee failed.
    #[error("{op} on pid {pid}: {source}")]
    Ptrace {
        /// Request name (`PTRACE_SEIZE`, `waitpid`, ...).
        op: &'static str,
        /// Host pid of the tracee.
        pid: i32,
        /// The errno.
        source: io::Error,
    },
    /// The tracee did not stop in time.
    #[error("pid {pid} did not stop within {timeout:?} (is its cgroup still frozen?)")]
    Timeout {
        /// Host pid.
        pid: i32,
        /// How long we waited.
        timeout: Duration,
    },
    /// The tracee exited or was killed while we worked on it.
    #[error("pid {pid} {how} while being forked")]
    Exited {
        /// Host pid.
        pid: i32,
        /// "exited with status N" / "was killed by signal N".
        how: String,
    },
    /// The tracee is not in the ptrace-stop this operation needs.
    #[error("pid {pid} is not stopped under our ptrace ({what})")]
    NotStopped {
        /// Host pid.
        pid: i32,
        /// What was expected.
        what: &'static str,
    },
    /// An injected syscall failed inside the tracee.
    #[error("injected {syscall} in pid {pid}{ctx}: {source}", ctx = context_suffix(.context))]
    Injected {
        /// Syscall name.
        syscall: &'static str,
        /// Host pid of the process it ran in.
        pid: i32,
        /// What it was for (an fd, a path, a namespace), may be empty.
        context: String,
        /// The errno it returned.
        source: io::Error,
    },
    /// A syscall made by the tracer itself failed.
    #[error("{op} for pid {pid}: {source}")]
    Sys {
        /// Syscall or operation name.
        op: &'static str,
        /// Host pid of the process concerned.
        pid: i32,
        /// The errno.
        source: io::Error,
    },
    /// A `/proc` file could not be read.
    #[error("reading {path}: {source}")]
    Proc {
        /// The file.
        path: PathBuf,
        /// The errno.
        source: io::Error,
    },
    /// A page of a checkpoint image could not be stored or read back (a
    /// corrupt or truncated page file included).
    #[error("checkpoint image, {what}: {source}")]
    Image {
        /// Which page.
        what: String,
        /// What failed.
        source: io::Error,
    },
    /// A `/proc` file had unexpected contents.
    #[error("cannot parse {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
    /// No `syscall` instruction could be found to inject through.
    #[error("no syscall instruction found in the [vdso] or executable mappings of pid {pid}")]
    NoSyscallInstruction {
        /// Host pid.
        pid: i32,
    },
    /// An fd of the template has no rule in the clone fd matrix.
    #[error("fd {fd} of pid {pid} ({kind}) cannot be cloned: {reason}")]
    UnsupportedFd {
        /// Host pid of the template.
        pid: i32,
        /// The fd number.
        fd: i32,
        /// What the fd is (`/proc/PID/fd` link text).
        kind: String,
        /// Why it has no rule.
        reason: String,
    },
    /// Moving the new process into its cgroup failed.
    #[error("moving pid {pid} into the cgroup through {path}: {source}")]
    Cgroup {
        /// Host pid (tid) written.
        pid: i32,
        /// The `tasks` / `cgroup.procs` file.
        path: PathBuf,
        /// The errno.
        source: io::Error,
    },
    /// The fork plan is inconsistent.
    #[error("invalid fork plan: {0}")]
    Plan(String),
    /// Something of the template a clone cannot reproduce (a process tree, a
    /// mapping), said in one line naming the process.
    #[error("{0}")]
    Unclonable(String),
    /// An injected call or batch faulted (the kernel raised a synchronous
    /// signal at it); the signal is not delivered.
    #[error("process {pid} faulted with signal {signal} {what}")]
    Faulted {
        /// Host pid of the process.
        pid: i32,
        /// The signal (SIGSEGV, SIGBUS, SIGILL, SIGFPE).
        signal: i32,
        /// Where: which injection.
        what: &'static str,
    },
    /// A mapping of the process cannot be given to the clone as its own object.
    #[error("mapping {range} ({name}) of pid {pid} cannot be made private to the clone: {reason}")]
    UnsupportedMapping {
        /// Host pid of the process.
        pid: i32,
        /// The range, as `/proc/PID/maps` shows it.
        range: String,
        /// The mapped object's name.
        name: String,
        /// Why.
        reason: String,
    },
    /// A monitor filter cannot be attached to the process (no
    /// `no_new_privs`, its filters at the kernel's limit, a listener
    /// already there), said in one line naming it.
    #[error("process {pid}: {why}")]
    NotAttachable {
        /// Host pid of the process.
        pid: i32,
        /// Why.
        why: String,
    },
}

fn context_suffix(context: &str) -> String {
    if context.is_empty() {
        String::new()
    } else {
        format!(" ({context})")
    }
}

impl RemoteError {
    /// The errno of the underlying failure, when there is one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            RemoteError::Ptrace { source, .. }
            | RemoteError::Injected { source, .. }
            | RemoteError::Sys { source, .. }
            | RemoteError::Proc { source, .. }
            | RemoteError::Cgroup { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}
