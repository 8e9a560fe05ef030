//! The errors of the E2B API, each with the HTTP status (control plane and
//! `/files`) and Connect code (envd RPC) the SDK maps to its exceptions.

use std::path::PathBuf;

use nestbox_runtime::error::ErrorKind;
use nestbox_runtime::RuntimeError;

/// An error of the E2B API.
#[derive(Debug, thiserror::Error)]
pub enum E2bError {
    /// No `X-API-KEY`, or one the server was not given.
    #[error("invalid or missing API key")]
    Unauthorized,
    /// An envd request without the sandbox's access token.
    #[error("invalid or missing access token of sandbox {0:?}")]
    BadAccessToken(String),
    /// A signed file URL whose signature no sandbox's token makes.
    #[error("invalid signature")]
    BadSignature,
    /// A signed file URL past its expiration.
    #[error("signature is already expired")]
    SignatureExpired,
    /// An envd request without the `E2b-Sandbox-Id` header.
    #[error("no E2b-Sandbox-Id header: envd requests name their sandbox in it")]
    NoSandboxHeader,
    /// No sandbox of that id (killed, timed out, or never made).
    #[error("sandbox {0:?} was not found")]
    NoSuchSandbox(String),
    /// A template name that is no nestbox template and no image.
    #[error("template {0:?} not found: it is no nestbox template and no image")]
    NoSuchTemplate(String),
    /// The sandbox is paused and the request needs it running.
    #[error("sandbox {0:?} is paused: connect to resume it")]
    Paused(String),
    /// Pause of a paused sandbox.
    #[error("sandbox {0:?} is already paused")]
    AlreadyPaused(String),
    /// A bad request: its message says what.
    #[error("{0}")]
    Invalid(String),
    /// A path, process or route that does not exist.
    #[error("{0}")]
    NotFound(String),
    /// A process ran past the caller's deadline.
    #[error("{0}")]
    Deadline(String),
    /// A file or directory that is already there.
    #[error("{0}")]
    Exists(String),
    /// An HTTP method or RPC this server does not offer.
    #[error("{0} is not supported by nestbox")]
    Unsupported(String),
    /// A `nestbox` command the server ran failed; its one-line message.
    #[error("{what}: {message}")]
    Command {
        /// What was being done.
        what: String,
        /// The command's error line (without `nestbox: error: `).
        message: String,
        /// The kind, read from the message.
        kind: CommandKind,
    },
    /// The clone server on the Unix socket could not be reached or answered
    /// something else than its protocol.
    #[error("the clone server on {}: {message}", socket.display())]
    CloneServer {
        /// Its socket.
        socket: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A system call on a path failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// The operation.
        op: &'static str,
        /// The path (in the sandbox, when about its files).
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// An error of the runtime.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

/// What a failed `nestbox` command was about, as far as the caller cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommandKind {
    /// Something named does not exist (box, template, image).
    NotFound,
    /// A conflict (name in use, wrong state).
    Conflict,
    /// Anything else.
    Other,
}

/// Connect-protocol error codes (the subset used).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// `invalid_argument`
    InvalidArgument,
    /// `unauthenticated`
    Unauthenticated,
    /// `not_found`
    NotFound,
    /// `already_exists`
    AlreadyExists,
    /// `failed_precondition`
    FailedPrecondition,
    /// `unimplemented`
    Unimplemented,
    /// `deadline_exceeded`
    DeadlineExceeded,
    /// `internal`
    Internal,
}

impl Code {
    /// Its name on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Code::InvalidArgument => "invalid_argument",
            Code::Unauthenticated => "unauthenticated",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::Internal => "internal",
        }
    }

    /// The HTTP status of a unary error with this code (Connect spec).
    pub fn http_status(self) -> u16 {
        match self {
            Code::InvalidArgument | Code::FailedPrecondition => 400,
            Code::Unauthenticated => 401,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::Unimplemented => 501,
            Code::DeadlineExceeded => 504,
            Code::Internal => 500,
        }
    }
}

impl E2bError {
    /// The HTTP status the SDK expects for this error.
    pub fn status(&self) -> u16 {
        self.code().http_status()
    }

    /// The Connect code of this error.
    pub fn code(&self) -> Code {
        match self {
            E2bError::Unauthorized
            | E2bError::BadAccessToken(_)
            | E2bError::BadSignature
            | E2bError::SignatureExpired => Code::Unauthenticated,
            E2bError::NoSandboxHeader | E2bError::Invalid(_) => Code::InvalidArgument,
            E2bError::NoSuchSandbox(_) | E2bError::NoSuchTemplate(_) | E2bError::NotFound(_) => {
                Code::NotFound
            }
            E2bError::AlreadyPaused(_) | E2bError::Exists(_) => Code::AlreadyExists,
            E2bError::Paused(_) => Code::FailedPrecondition,
            E2bError::Unsupported(_) => Code::Unimplemented,
            E2bError::Deadline(_) => Code::DeadlineExceeded,
            E2bError::Command { kind, .. } => match kind {
                CommandKind::NotFound => Code::NotFound,
                CommandKind::Conflict => Code::AlreadyExists,
                CommandKind::Other => Code::Internal,
            },
            E2bError::Io { source, .. } => match source.kind() {
                std::io::ErrorKind::NotFound => Code::NotFound,
                std::io::ErrorKind::AlreadyExists => Code::AlreadyExists,
                std::io::ErrorKind::InvalidInput => Code::InvalidArgument,
                _ if source.raw_os_error() == Some(libc::ENOTDIR)
                    || source.raw_os_error() == Some(libc::EISDIR)
                    || source.raw_os_error() == Some(libc::ENOTEMPTY) =>
                {
                    Code::InvalidArgument
                }
                _ => Code::Internal,
            },
            E2bError::CloneServer { .. } => Code::Internal,
            E2bError::Runtime(e) => match e.kind() {
                ErrorKind::NotFound => Code::NotFound,
                ErrorKind::Invalid => Code::InvalidArgument,
                ErrorKind::Conflict => Code::AlreadyExists,
                _ => Code::Internal,
            },
        }
    }

    /// A failed system call on `path`.
    pub fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| E2bError::Io { op, path, source }
    }
}

/// Results of this crate.
pub type Result<T, E = E2bError> = std::result::Result<T, E>;
