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

/// The smallest id range a nested box gets: below it (a namespace of fewer
/// than twice as many ids), box root maps to the caller's own id only.
pub const NESTED_MIN_SIZE: u32 = 1024;

impl IdMap {
    /// The map for the calling user: as root, box ids 0..65536 map to a high,
    /// unused host range; as anyone else, box root is the caller (one id only).
    /// As root of a user namespace (a nestbox running in a box, see
    /// `docs/nesting.md`), the box gets the upper half of the ids the caller's
    /// namespace has: [`IdMap::nested`].
    pub fn for_caller() -> Self {
        let uid = nix::unistd::geteuid().as_raw();
        let gid = nix::unistd::getegid().as_raw();
        if uid == 0 {
            if let Some(own) = current_maps().filter(|m| !m.is_initial()) {
                return IdMap::nested(&own, uid, gid);
            }
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

    /// The map of a box made by root of a user namespace whose own maps are
    /// `own`: box ids `0..n/2` map to the upper half `n/2..n` of the ids the
    /// namespace has (counted from 0, the first contiguous range), so box root
    /// is neither the caller's root nor any id the caller's root runs as by
    /// default, and three or more levels fit (65536, 32768, 16384, ...). A
    /// namespace with fewer than `2 * NESTED_MIN_SIZE` ids maps box root to the
    /// caller (`uid`, `gid`) only.
    pub fn nested(own: &OwnMaps, uid: u32, gid: u32) -> Self {
        let half = |ranges: &[IdRange], me: u32| {
            let n = contiguous_from_zero(ranges);
            if n >= 2 * NESTED_MIN_SIZE {
                IdRange {
                    inside: 0,
                    outside: n / 2,
                    count: n / 2,
                }
            } else {
                IdRange {
                    inside: 0,
                    outside: me,
                    count: 1,
                }
            }
        };
        IdMap {
            uid: half(&own.uid, uid),
            gid: half(&own.gid, gid),
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
    /// (Inside a box, "host" ids are those of the caller's namespace.)
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

/// The id maps of the calling process's user namespace, as
/// `/proc/self/uid_map` and `gid_map` show them (relative to the parent
/// namespace).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnMaps {
    /// Uid ranges.
    pub uid: Vec<IdRange>,
    /// Gid ranges.
    pub gid: Vec<IdRange>,
}

impl OwnMaps {
    /// Parse the text of `uid_map` and `gid_map` (`INSIDE OUTSIDE COUNT` lines).
    pub fn parse(uid_map: &str, gid_map: &str) -> Self {
        let parse = |text: &str| {
            text.lines()
                .filter_map(|l| {
                    let mut it = l.split_whitespace().map(|f| f.parse::<u32>());
                    match (it.next(), it.next(), it.next()) {
                        (Some(Ok(inside)), Some(Ok(outside)), Some(Ok(count))) => Some(IdRange {
                            inside,
                            outside,
                            count,
                        }),
                        _ => None,
                    }
                })
                .collect()
        };
        OwnMaps {
            uid: parse(uid_map),
            gid: parse(gid_map),
        }
    }

    /// Whether these are the initial namespace's maps (every id to itself).
    pub fn is_initial(&self) -> bool {
        let full = |r: &[IdRange]| matches!(r, [IdRange { inside: 0, outside: 0, count }] if *count == u32::MAX);
        full(&self.uid) && full(&self.gid)
    }
}

/// The calling process's own id maps (`None` if `/proc` cannot tell).
pub fn current_maps() -> Option<OwnMaps> {
    let uid = std::fs::read_to_string("/proc/self/uid_map").ok()?;
    let gid = std::fs::read_to_string("/proc/self/gid_map").ok()?;
    Some(OwnMaps::parse(&uid, &gid))
}

/// Whether the calling process runs in a user namespace other than the
/// initial one: inside a box (nestbox nested in a box), or in another
/// runtime's unprivileged container.
pub fn in_user_namespace() -> bool {
    current_maps().is_some_and(|m| !m.is_initial())
}

/// How many ids from 0 up a namespace has without a gap.
fn contiguous_from_zero(ranges: &[IdRange]) -> u32 {
    let mut next: u64 = 0;
    loop {
        let Some(r) = ranges.iter().find(|r| {
            u64::from(r.inside) <= next && next < u64::from(r.inside) + u64::from(r.count)
        }) else {
            return next.min(u64::from(u32::MAX)) as u32;
        };
        next = u64::from(r.inside) + u64::from(r.count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_initial_namespace_is_recognised() {
        let m = OwnMaps::parse("         0          0 4294967295\n", "0 0 4294967295\n");
        assert!(m.is_initial());
        let boxed = OwnMaps::parse("0 1000000000 65536\n", "0 1000000000 65536\n");
        assert!(!boxed.is_initial());
    }

    #[test]
    fn nested_boxes_get_the_upper_half_of_their_parents_ids() {
        let l1 = OwnMaps::parse("0 1000000000 65536\n", "0 1000000000 65536\n");
        let m = IdMap::nested(&l1, 0, 0);
        let want = IdRange {
            inside: 0,
            outside: 32768,
            count: 32768,
        };
        assert_eq!((m.uid, m.gid), (want, want));
        assert!(m.allows_setgroups());
        assert_eq!(m.host_root(), (32768, 32768));
        // Three levels: 65536, 32768, 16384.
        let l2 = OwnMaps::parse("0 32768 32768\n", "0 32768 32768\n");
        assert_eq!(IdMap::nested(&l2, 0, 0).uid.outside, 16384);
        // Split ranges count only from 0 up to the first gap.
        let split = OwnMaps::parse("0 100 4096\n4096 9000 4096\n", "0 100 8192\n");
        assert_eq!(IdMap::nested(&split, 0, 0).uid.count, 4096);
        // Too few ids: box root is the caller.
        let small = OwnMaps::parse("0 1000 1\n", "0 1000 1\n");
        let m = IdMap::nested(&small, 0, 0);
        assert_eq!((m.uid.count, m.uid.outside), (1, 0));
        assert!(!m.allows_setgroups());
    }
}
