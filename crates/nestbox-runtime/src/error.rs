//! Runtime errors. Each keeps its context (the box, the path, the call) and
//! displays as one line a person can act on; each maps to the CLI's exit code.

use std::path::PathBuf;

/// Exit code for an error of nestbox itself (as Docker uses).
pub const EXIT_NESTBOX_ERROR: i32 = 125;
/// Exit code when the command exists but cannot be executed.
pub const EXIT_CANNOT_EXECUTE: i32 = 126;
/// Exit code when the command is not found in the box.
pub const EXIT_NOT_FOUND: i32 = 127;

/// What kind of failure an error is, for programs (the API's `"kind"`): a
/// user's mistake, a missing object, a conflict with the current state of an
/// object, a lack of resources, a failure of the system, or a command that
/// could not be started in its box.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request can never succeed as given: a bad option, value or name, a
    /// malformed API request, a box that cannot serve for the operation.
    Invalid,
    /// A box, template, image or network of that name does not exist.
    NotFound,
    /// The current state of an object prevents the operation (a name in use, a
    /// box still running or not running, a network that still has boxes); it
    /// may succeed once that state changes.
    Conflict,
    /// Not enough of a resource (processes, memory) for the operation.
    Resources,
    /// The system failed: a call, a file, a process that vanished.
    System,
    /// The command could not be started in the box (exit codes 125-127).
    Launch,
}

impl ErrorKind {
    /// The kind as the API writes it (`"not_found"`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Invalid => "invalid",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Conflict => "conflict",
            ErrorKind::Resources => "resources",
            ErrorKind::System => "system",
            ErrorKind::Launch => "launch",
        }
    }
}

/// Everything that can go wrong managing a box.
///
/// Every message is one line and complete: a variant that wraps a cause shows
/// the cause's text in its own message (as every nestbox error type does), so a
/// caller prints the outermost message alone, never the chain of sources.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A user's mistake in a request: a bad option, value or name, a malformed
    /// API request.
    #[error("{0}")]
    InvalidInput(String),
    /// A box that cannot serve for the operation by what it is (no cgroup, more
    /// than one process, a process that is not root, …).
    #[error("box {name:?} {problem}")]
    Unsupported {
        /// The box.
        name: String,
        /// What it has or lacks, starting with a verb ("has 3 processes …").
        problem: String,
    },
    /// No box of that name.
    #[error("no box named {0:?}")]
    NoSuchBox(String),
    /// No template of that name.
    #[error("no template named {0:?}")]
    NoSuchTemplate(String),
    /// The template was removed (it waits for its clones to go).
    #[error("template {0:?} has been removed")]
    TemplateRemoved(String),
    /// The name is taken.
    #[error("a box named {0:?} already exists")]
    NameInUse(String),
    /// The template name is taken.
    #[error("a template named {name:?} already exists (box {box_name:?})")]
    TemplateNameInUse {
        /// The template name.
        name: String,
        /// The box that is that template.
        box_name: String,
    },
    /// No checkpoint of that name (or directory).
    #[error("no checkpoint named {0:?}")]
    NoSuchCheckpoint(String),
    /// The checkpoint name is taken.
    #[error("a checkpoint named {0:?} already exists")]
    CheckpointExists(String),
    /// A checkpoint cannot be written or used as it is.
    #[error("checkpoint {name:?} {problem}")]
    Checkpoint {
        /// The checkpoint (or its file).
        name: String,
        /// What is wrong.
        problem: String,
    },
    /// No snapshot of that name of the box.
    #[error("box {box_name:?} has no snapshot named {name:?}")]
    NoSuchSnapshot {
        /// The box.
        box_name: String,
        /// The snapshot asked for.
        name: String,
    },
    /// The snapshot named is another box's.
    #[error("snapshot {name:?} is of box {owner:?}, not of box {box_name:?}")]
    SnapshotOfOtherBox {
        /// The box asked for.
        box_name: String,
        /// The snapshot.
        name: String,
        /// The box it belongs to.
        owner: String,
    },
    /// The box already has a snapshot of that name.
    #[error("box {box_name:?} already has a snapshot named {name:?}")]
    SnapshotExists {
        /// The box.
        box_name: String,
        /// The name.
        name: String,
    },
    /// The store failed while taking, reading or restoring a snapshot.
    #[error("snapshot of box {box_name:?}: {source}")]
    Snapshot {
        /// The box.
        box_name: String,
        /// The store's error.
        source: nestbox_store::StoreError,
    },
    /// A migration could not be made (the target refused it, the stream
    /// broke); the box goes on where it was.
    #[error("migration of box {name:?}: {problem}")]
    Migrate {
        /// The box.
        name: String,
        /// What went wrong.
        problem: String,
    },
    /// The box is not running.
    #[error("box {0:?} is not running")]
    NotRunning(String),
    /// The operation needs a stopped box.
    #[error("box {0:?} is running: stop it first, or use rm -f")]
    StillRunning(String),
    /// The box is not in the state the operation needs.
    #[error("box {name:?} {problem}")]
    WrongState {
        /// The box.
        name: String,
        /// Its state, starting with a verb ("is already frozen").
        problem: String,
    },
    /// A network still has boxes attached.
    #[error("network {network:?} still has {count} box(es) (box id {box_id}): remove them first")]
    NetworkInUse {
        /// The network.
        network: String,
        /// How many boxes hold an address in it.
        count: usize,
        /// One of them.
        box_id: String,
    },
    /// A server already answers on the API socket.
    #[error("a server already answers on {}", .0.display())]
    ServerRunning(PathBuf),
    /// Not enough of a resource for the operation.
    #[error("{0}")]
    Resources(String),
    /// The command could not be started in the box.
    #[error("{message}")]
    Launch {
        /// 126 (cannot execute), 127 (not found) or 125.
        code: i32,
        /// What went wrong, one line.
        message: String,
    },
    /// Forking a clone from its template failed.
    #[error("{what} {name:?}: {source}")]
    Remote {
        /// What was being done ("forking clone").
        what: &'static str,
        /// The template box or the clone.
        name: String,
        /// The cause.
        source: nestbox_remote::RemoteError,
    },
    /// The system did not do what it should have, without an errno to tell (a
    /// process that vanished, a helper that failed).
    #[error("{0}")]
    Failed(String),
    /// The kernel gave no random bytes.
    #[error("no randomness for {what}: {cause}")]
    Random {
        /// What they were for.
        what: &'static str,
        /// The cause.
        cause: getrandom::Error,
    },
    /// A filesystem operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// The operation.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A kernel call failed.
    #[error("{call}: {errno}")]
    Sys {
        /// The call, with its subject.
        call: String,
        /// The errno.
        errno: nix::errno::Errno,
    },
    /// Stored state could not be read.
    #[error("corrupt state {path}: {source}")]
    State {
        /// The state file.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// Cgroup failure.
    #[error(transparent)]
    Cgroup(#[from] nestbox_cgroup::CgroupError),
    /// Seccomp failure.
    #[error(transparent)]
    Seccomp(#[from] nestbox_seccomp::SeccompError),
    /// Namespace, mount or capability failure.
    #[error(transparent)]
    Isolation(#[from] nestbox_isolation::IsolationError),
    /// Image failure.
    #[error(transparent)]
    Image(#[from] nestbox_image::ImageError),
    /// Networking failure.
    #[error(transparent)]
    Network(#[from] nestbox_net::NetError),
    /// An error concerning the box `name` whose own message does not name it.
    #[error("box {name:?}: {source}")]
    InBox {
        /// The box.
        name: String,
        /// The error.
        source: Box<RuntimeError>,
    },
}

impl RuntimeError {
    /// A closure turning an `io::Error` of `op` on `path` into a `RuntimeError`.
    pub fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| RuntimeError::Io { op, path, source }
    }

    /// A closure turning an errno of `call` into a `RuntimeError`.
    pub fn sys(call: impl Into<String>) -> impl FnOnce(nix::errno::Errno) -> Self {
        let call = call.into();
        move |errno| RuntimeError::Sys { call, errno }
    }

    /// The process exit code the CLI should use for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            RuntimeError::Launch { code, .. } => *code,
            RuntimeError::InBox { source, .. } => source.exit_code(),
            _ => EXIT_NESTBOX_ERROR,
        }
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        use RuntimeError as E;
        match self {
            E::InvalidInput(_) | E::Unsupported { .. } | E::Checkpoint { .. } => ErrorKind::Invalid,
            E::Migrate { .. } => ErrorKind::System,
            E::NoSuchBox(_)
            | E::NoSuchTemplate(_)
            | E::TemplateRemoved(_)
            | E::NoSuchCheckpoint(_)
            | E::NoSuchSnapshot { .. } => ErrorKind::NotFound,
            E::SnapshotOfOtherBox { .. } => ErrorKind::Invalid,
            E::Snapshot { .. } => ErrorKind::System,
            E::NameInUse(_)
            | E::CheckpointExists(_)
            | E::SnapshotExists { .. }
            | E::TemplateNameInUse { .. }
            | E::NotRunning(_)
            | E::StillRunning(_)
            | E::WrongState { .. }
            | E::NetworkInUse { .. }
            | E::ServerRunning(_) => ErrorKind::Conflict,
            E::Resources(_) => ErrorKind::Resources,
            E::Launch { .. } => ErrorKind::Launch,
            E::Image(nestbox_image::ImageError::Unknown(_)) => ErrorKind::NotFound,
            E::Image(nestbox_image::ImageError::Unsupported { .. }) => ErrorKind::Invalid,
            E::Network(n) => net_kind(n),
            E::Remote { .. }
            | E::Failed(_)
            | E::Random { .. }
            | E::Io { .. }
            | E::Sys { .. }
            | E::State { .. }
            | E::Cgroup(_)
            | E::Seccomp(_)
            | E::Isolation(_)
            | E::Image(_) => ErrorKind::System,
            E::InBox { source, .. } => source.kind(),
        }
    }

    /// The box this error concerns, when it names one.
    pub fn box_name(&self) -> Option<&str> {
        use RuntimeError as E;
        match self {
            E::Unsupported { name, .. }
            | E::WrongState { name, .. }
            | E::InBox { name, .. }
            | E::TemplateNameInUse { box_name: name, .. } => Some(name),
            E::NoSuchBox(name)
            | E::NameInUse(name)
            | E::NotRunning(name)
            | E::StillRunning(name) => Some(name),
            _ => None,
        }
    }

    /// This error, naming the box `name` if it does not name a box already (a
    /// command's own launch failure is left as it is: it names the command).
    pub fn in_box(self, name: &str) -> Self {
        match self {
            e @ RuntimeError::Launch { .. } => e,
            e if e.box_name().is_some() => e,
            e => RuntimeError::InBox {
                name: name.to_string(),
                source: Box::new(e),
            },
        }
    }
}

/// The kind of a networking error.
fn net_kind(e: &nestbox_net::NetError) -> ErrorKind {
    use nestbox_net::NetError as N;
    match e {
        N::InvalidRate(_)
        | N::InvalidPort(_)
        | N::InvalidSubnet { .. }
        | N::Invalid(_)
        | N::SubnetOverlap { .. } => ErrorKind::Invalid,
        N::PortInUse { .. } | N::AlreadyAttached(_) => ErrorKind::Conflict,
        N::PoolExhausted { .. } => ErrorKind::Resources,
        N::Box { source, .. } => net_kind(source),
        _ => ErrorKind::System,
    }
}

/// Result of runtime operations.
pub type Result<T> = std::result::Result<T, RuntimeError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_tell_mistakes_missing_objects_conflicts_and_failures_apart() {
        assert_eq!(
            RuntimeError::InvalidInput("x".into()).kind(),
            ErrorKind::Invalid
        );
        assert_eq!(
            RuntimeError::NoSuchBox("b".into()).kind(),
            ErrorKind::NotFound
        );
        assert_eq!(
            RuntimeError::NoSuchTemplate("t".into()).kind(),
            ErrorKind::NotFound
        );
        assert_eq!(
            RuntimeError::NameInUse("b".into()).kind(),
            ErrorKind::Conflict
        );
        assert_eq!(
            RuntimeError::StillRunning("b".into()).kind(),
            ErrorKind::Conflict
        );
        let sys = RuntimeError::sys("setns")(nix::errno::Errno::EPERM);
        assert_eq!(sys.kind(), ErrorKind::System);
        assert_eq!(
            serde_json::to_value(ErrorKind::NotFound).unwrap(),
            serde_json::json!(ErrorKind::NotFound.as_str())
        );
    }

    #[test]
    fn errors_name_their_box_once() {
        let e = RuntimeError::sys("kill SIGTERM")(nix::errno::Errno::ESRCH).in_box("web");
        assert_eq!(e.box_name(), Some("web"));
        assert_eq!(e.kind(), ErrorKind::System);
        assert_eq!(
            e.to_string(),
            format!("box \"web\": kill SIGTERM: {}", nix::errno::Errno::ESRCH)
        );
        // An error that names its box already is left as it is, and wrapping twice
        // names the box once.
        let e = e.in_box("other");
        assert_eq!(e.box_name(), Some("web"));
        let e = RuntimeError::NoSuchBox("web".into()).in_box("web");
        assert_eq!(e.to_string(), "no box named \"web\"");
        // A launch failure keeps its message and its exit code.
        let e = RuntimeError::Launch {
            code: 127,
            message: "nosuch: not found".into(),
        }
        .in_box("web");
        assert_eq!((e.exit_code(), e.kind()), (127, ErrorKind::Launch));
        assert_eq!(e.to_string(), "nosuch: not found");
    }
}
