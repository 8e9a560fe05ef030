//! Errors of the image store, each naming what it was done to: the path and the
//! operation or syscall, the image, the archive entry.

use std::path::PathBuf;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A filesystem operation or syscall on a path failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done (the syscall or operation).
        op: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// No image of that name exists in the store.
    #[error("image {0:?} not found")]
    NoSuchImage(String),
    /// The image name is taken.
    #[error("image name {0:?} is already in use")]
    NameInUse(String),
    /// The image name cannot be used.
    #[error("invalid image name {name:?}: {why}")]
    BadName {
        /// The name given.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The source is none of the formats the store imports.
    #[error("{0}: unknown format (expected a directory, a tar, tar.gz or tar.zst root filesystem, an OCI image layout or a docker save archive)")]
    UnknownFormat(PathBuf),
    /// The archive or layout is damaged: truncated, bad checksum, bad JSON, missing blob.
    #[error("{path}: corrupt or truncated input: {why}")]
    Corrupt {
        /// The archive, layout or blob.
        path: PathBuf,
        /// What was found wrong.
        why: String,
    },
    /// An entry of the input is refused (escapes the root, device without permission...).
    #[error("{path}: entry {entry:?} refused: {why}")]
    Refused {
        /// The archive or directory.
        path: PathBuf,
        /// The entry's name as found in the input.
        entry: String,
        /// Why it is refused.
        why: String,
    },
    /// A stored manifest cannot be read.
    #[error("manifest {id}: {why}")]
    BadManifest {
        /// The manifest's object id.
        id: String,
        /// What is wrong.
        why: String,
    },
    /// An object a manifest names is not in the store.
    #[error("object {0} is missing from the store (run `nestbox store verify`)")]
    MissingObject(String),
    /// A request the store cannot honour, with the reason.
    #[error("{0}")]
    Unsupported(String),
    /// What references the store from outside (box snapshots) could not be
    /// listed, so `gc` removed nothing.
    #[error("store gc: {0}")]
    Referrers(String),
    /// The kernel's random source (`getrandom`) failed; names that must not
    /// collide are not made up from anything weaker.
    #[error("getrandom: {0}")]
    Random(#[source] std::io::Error),
}

impl StoreError {
    /// A closure turning an I/O error into [`StoreError::Io`] about `path`.
    pub fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| StoreError::Io { op, path, source }
    }

    /// Same, from a `nix` errno.
    pub fn sys(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(nix::errno::Errno) -> Self {
        let path = path.into();
        move |e| StoreError::Io {
            op,
            path,
            source: std::io::Error::from_raw_os_error(e as i32),
        }
    }

    /// A corrupt-input error. The reason is made one line: a parser's message
    /// may quote the input's bytes (a tar name with a newline in it).
    pub fn corrupt(path: impl Into<PathBuf>, why: impl std::fmt::Display) -> Self {
        StoreError::Corrupt {
            path: path.into(),
            why: one_line(&why.to_string()),
        }
    }

    /// A refused-entry error.
    pub fn refused(
        path: impl Into<PathBuf>,
        entry: impl Into<String>,
        why: impl Into<String>,
    ) -> Self {
        StoreError::Refused {
            path: path.into(),
            entry: entry.into(),
            why: one_line(&why.into()),
        }
    }
}

/// Result of store operations.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// `text` with control characters (newlines among them) escaped, so an error
/// quoting hostile input still displays as one line.
pub(crate) fn one_line(text: &str) -> String {
    if !text.chars().any(char::is_control) {
        return text.to_string();
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by `tests/fuzz_import.rs`: the tar crate quotes a header's name
    /// (newlines, control bytes) in its checksum error.
    #[test]
    fn corrupt_input_errors_are_one_line() {
        let e = StoreError::corrupt(
            "/in.tar",
            "numeric field was not a number:  when getting cksum for \n\u{1a}x\r",
        );
        assert_eq!(
            e.to_string(),
            "/in.tar: corrupt or truncated input: numeric field was not a number:  when getting cksum for \\n\\u{1a}x\\r"
        );
        let e = StoreError::refused("/in.tar", "a", "bad\ttarget\n");
        assert!(!e.to_string().contains(['\n', '\t']), "{e}");
    }
}
