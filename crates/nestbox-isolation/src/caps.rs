//! Capabilities of the processes in a box: Docker's default set, adjusted by
//! `--cap-add` / `--cap-drop`, enforced as the bounding set so no process in the
//! box can ever regain anything outside it.

use std::collections::BTreeSet;
use std::str::FromStr;

use caps::{CapSet, Capability, CapsHashSet};

use crate::{IsolationError, Result};

/// Docker's default capability set for containers.
pub const DEFAULT_CAPS: &[Capability] = &[
    Capability::CAP_CHOWN,
    Capability::CAP_DAC_OVERRIDE,
    Capability::CAP_FSETID,
    Capability::CAP_FOWNER,
    Capability::CAP_MKNOD,
    Capability::CAP_NET_RAW,
    Capability::CAP_SETGID,
    Capability::CAP_SETUID,
    Capability::CAP_SETFCAP,
    Capability::CAP_SETPCAP,
    Capability::CAP_NET_BIND_SERVICE,
    Capability::CAP_SYS_CHROOT,
    Capability::CAP_KILL,
    Capability::CAP_AUDIT_WRITE,
];

/// A capability name the kernel does not know.
#[derive(Debug, thiserror::Error)]
#[error("unknown capability {0:?} (expected a name like NET_ADMIN or CAP_NET_ADMIN, or ALL)")]
pub struct UnknownCapability(pub String);

/// The capability set of a box, by canonical name (`CAP_...`), in a stable order.
pub type CapNames = BTreeSet<String>;

fn parse_one(name: &str) -> std::result::Result<Capability, UnknownCapability> {
    let upper = name.trim().to_ascii_uppercase();
    let full = if upper.starts_with("CAP_") {
        upper
    } else {
        format!("CAP_{upper}")
    };
    Capability::from_str(&full).map_err(|_| UnknownCapability(name.to_string()))
}

/// Docker's defaults plus `add` minus `drop`; `ALL` stands for every capability.
pub fn resolve(
    add: &[String],
    drop: &[String],
) -> std::result::Result<CapNames, UnknownCapability> {
    let mut set: CapsHashSet = DEFAULT_CAPS.iter().copied().collect();
    for name in add {
        if name.eq_ignore_ascii_case("ALL") {
            set = caps::all();
        } else {
            set.insert(parse_one(name)?);
        }
    }
    for name in drop {
        if name.eq_ignore_ascii_case("ALL") {
            set.clear();
        } else {
            set.remove(&parse_one(name)?);
        }
    }
    Ok(set.into_iter().map(|c| c.to_string()).collect())
}

fn to_set(names: &CapNames) -> CapsHashSet {
    names
        .iter()
        .filter_map(|n| Capability::from_str(n).ok())
        .collect()
}

/// Drop every capability outside `names` from the bounding set. Needs CAP_SETPCAP,
/// so it runs before the process changes to a non-root user.
pub fn restrict_bounding(names: &CapNames) -> Result<()> {
    let keep = to_set(names);
    for cap in caps::all() {
        if !keep.contains(&cap) && caps::has_cap(None, CapSet::Bounding, cap).unwrap_or(false) {
            caps::drop(None, CapSet::Bounding, cap).map_err(|_| {
                IsolationError::call(
                    format!("drop {cap} from bounding set"),
                    nix::errno::Errno::last(),
                )
            })?;
        }
    }
    Ok(())
}

/// Set the effective, permitted and inheritable sets after the user change: the box
/// set for uid 0, nothing for other users (as Docker does). No ambient capabilities.
pub fn apply_process_sets(names: &CapNames, uid_is_root: bool) -> Result<()> {
    let wanted = if uid_is_root {
        to_set(names)
    } else {
        CapsHashSet::new()
    };
    let fail = |what: &str| {
        IsolationError::call(
            format!("set {what} capabilities"),
            nix::errno::Errno::last(),
        )
    };
    caps::clear(None, CapSet::Ambient).map_err(|_| fail("ambient"))?;
    let permitted = caps::read(None, CapSet::Permitted).map_err(|_| fail("read permitted"))?;
    let target: CapsHashSet = wanted.intersection(&permitted).copied().collect();
    // Effective must stay within permitted at every step: shrink it first.
    caps::set(None, CapSet::Effective, &target).map_err(|_| fail("effective"))?;
    caps::set(None, CapSet::Permitted, &target).map_err(|_| fail("permitted"))?;
    caps::set(None, CapSet::Inheritable, &target).map_err(|_| fail("inheritable"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_docker() {
        let s = resolve(&[], &[]).unwrap();
        assert_eq!(s.len(), 14);
        assert!(s.contains("CAP_NET_BIND_SERVICE"));
        assert!(!s.contains("CAP_SYS_ADMIN"));
    }

    #[test]
    fn add_and_drop_accept_short_and_long_names() {
        let s = resolve(&["sys_admin".into()], &["CAP_CHOWN".into(), "mknod".into()]).unwrap();
        assert!(s.contains("CAP_SYS_ADMIN"));
        assert!(!s.contains("CAP_CHOWN"));
        assert!(!s.contains("CAP_MKNOD"));
        assert!(resolve(&[], &["ALL".into()]).unwrap().is_empty());
        assert!(resolve(&["ALL".into()], &[]).unwrap().len() > 30);
    }

    #[test]
    fn unknown_name_is_rejected() {
        let e = resolve(&["FLY".into()], &[]).unwrap_err();
        assert!(e.to_string().contains("\"FLY\""));
    }
}
