//! Image manifests: every path of a root filesystem with its kind, content object
//! and inode metadata. A manifest is serialised deterministically (sorted paths,
//! fixed field order) and stored as an object itself, so its digest is the image id.
//!
//! Paths are relative to the image root, `/`-separated, without `.` or `..`
//! components; the root itself is the empty path.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::hash::Digest;
use crate::meta::Meta;

/// Current manifest format.
pub const MANIFEST_VERSION: u32 = 1;

/// What a path is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Kind {
    /// A directory.
    Dir,
    /// A regular file whose content is `object`.
    File {
        /// Content digest.
        object: Digest,
        /// Content length in bytes.
        size: u64,
    },
    /// A symbolic link.
    Symlink {
        /// Its target, verbatim.
        target: String,
    },
    /// A character device.
    Char {
        /// Major number.
        major: u32,
        /// Minor number.
        minor: u32,
    },
    /// A block device.
    Block {
        /// Major number.
        major: u32,
        /// Minor number.
        minor: u32,
    },
    /// A named pipe.
    Fifo,
}

/// One path of an image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Kind and kind-specific data.
    #[serde(flatten)]
    pub kind: Kind,
    /// Inode metadata.
    #[serde(flatten)]
    pub meta: Meta,
}

impl Entry {
    /// Whether this entry is a directory.
    pub fn is_dir(&self) -> bool {
        matches!(self.kind, Kind::Dir)
    }
}

/// A whole image: path → entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version.
    pub version: u32,
    /// Every path, parents before children (sorted).
    pub entries: BTreeMap<String, Entry>,
}

impl Manifest {
    /// The canonical bytes (compact JSON) whose digest is the image id.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a manifest always serialises")
    }

    /// Parse canonical bytes.
    pub fn from_bytes(data: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(data)
    }

    /// Number of regular files and their total content bytes (the logical size).
    pub fn file_stats(&self) -> (u64, u64) {
        self.entries
            .values()
            .filter_map(|e| match e.kind {
                Kind::File { size, .. } => Some(size),
                _ => None,
            })
            .fold((0, 0), |(n, b), s| (n + 1, b + s))
    }

    /// Every (content digest, metadata key) a regular file of this image uses.
    pub fn inodes(&self) -> impl Iterator<Item = (Digest, String)> + '_ {
        self.entries.values().filter_map(|e| match e.kind {
            Kind::File { object, .. } => Some((object, e.meta.key())),
            _ => None,
        })
    }
}

/// The parent path of `path` ("" for top-level names), or None for the root.
pub fn parent(path: &str) -> Option<&str> {
    if path.is_empty() {
        return None;
    }
    Some(path.rfind('/').map_or("", |i| &path[..i]))
}

/// `dir` joined with `name`.
pub fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialisation_is_deterministic_and_round_trips() {
        let mut m = Manifest {
            version: MANIFEST_VERSION,
            entries: BTreeMap::new(),
        };
        m.entries.insert(
            "b".into(),
            Entry {
                kind: Kind::File {
                    object: Digest::of(b"x"),
                    size: 1,
                },
                meta: Meta {
                    mode: 0o644,
                    ..Meta::default()
                },
            },
        );
        m.entries.insert(
            "a".into(),
            Entry {
                kind: Kind::Symlink { target: "b".into() },
                meta: Meta::default(),
            },
        );
        let bytes = m.to_bytes();
        let back = Manifest::from_bytes(&bytes).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.to_bytes(), bytes);
        assert_eq!(m.file_stats(), (1, 1));
    }

    #[test]
    fn parents() {
        assert_eq!(parent(""), None);
        assert_eq!(parent("a"), Some(""));
        assert_eq!(parent("a/b/c"), Some("a/b"));
        assert_eq!(join("", "x"), "x");
        assert_eq!(join("a", "x"), "a/x");
    }
}
