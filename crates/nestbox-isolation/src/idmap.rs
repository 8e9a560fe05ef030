//! User-namespace id maps: written by the parent for a child in a new user namespace.

use nix::unistd::Pid;

use crate::{IsolationError, Result};

/// One contiguous id mapping: `count` ids from `inside` map to `outside`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IdRange {
    /// First id inside the box.
    pub inside: u32,
    /// First id on the host.
    pub outside: u32,
    /// Number of ids.
    pub count: u32,
}

/// The uid and gid maps of a box in a user namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IdMap {
    /// Uid mapping.
    pub uid: IdRange,
    /// Gid mapping.
    pub gid: IdRange,
}

/// First host id of the range root maps boxes to with `--userns`.
pub const ROOT_USERNS_BASE: u32 = 1_000_000_000;
/// Ids per box user namespace when root sets it up.
pub const ROOT_USERNS_SIZE: u32 = 65_536;

impl IdMap {
    /// The map for the calling user: as root, box ids 0..65536 map to a high,
    /// unused host range; as anyone else, box root is the caller (one id only).
    pub fn for_caller() -> Self {
        let uid = nix::unistd::geteuid().as_raw();
        let gid = nix::unistd::getegid().as_raw();
        if uid == 0 {
            let r = IdRange {
                inside: 0,
                outside: ROOT_USERNS_BASE,
                count: ROOT_USERNS_SIZE,
            };
            IdMap { uid: r, gid: r }
        } else {
            IdMap {
                uid: IdRange {
                    inside: 0,
                    outside: uid,
                    count: 1,
                },
                gid: IdRange {
                    inside: 0,
                    outside: gid,
                    count: 1,
                },
            }
        }
    }

    /// The host uid/gid box root maps to (owner of its writable layer).
    pub fn host_root(&self) -> (u32, u32) {
        (self.uid.outside, self.gid.outside)
    }

    /// Whether the box may call setgroups (only when the maps were written by root).
    pub fn allows_setgroups(&self) -> bool {
        self.uid.count > 1
    }

    /// Write the maps of `pid`, which must be in a fresh user namespace.
    pub fn apply(&self, pid: Pid) -> Result<()> {
        let write = |file: &str, text: String| {
            let path = format!("/proc/{pid}/{file}");
            std::fs::write(&path, text).map_err(|e| IsolationError::io("write", path, e))
        };
        if !self.allows_setgroups() {
            write("setgroups", "deny".into())?;
        }
        let line = |r: &IdRange| format!("{} {} {}\n", r.inside, r.outside, r.count);
        write("uid_map", line(&self.uid))?;
        write("gid_map", line(&self.gid))
    }
}
