//! CPU reservations (`--cpu-reserve CPUS`, Linux-VServer's idea): a box is
//! guaranteed that many CPUs' worth of time whenever it wants it, whatever
//! its siblings do.
//!
//! Neither v1 nor v2 has a "guaranteed CPU" knob for normal tasks (real-time
//! bandwidth aside), so the guarantee is made of weights: under CFS a
//! cgroup's share of its parent's CPU time, when every sibling is busy, is
//! its weight (v1 `cpu.shares`, v2 `cpu.weight`) over the sum of the
//! siblings' weights. For reservations `r_i` (sum `R`) among `N` CPUs, with
//! `U` the weight of everything unreserved that competes, the weights
//! `w_i = r_i * K` with `K = U / (N - R)` give box `i` at least `r_i` CPUs:
//! its fraction `w_i / (R K + U)` of the `N` CPUs is `r_i / N`. Competition
//! counted in `U`: every sibling cgroup without a reservation (at its current
//! weight, nestbox's or not), the base weight of each reserved one (a
//! reserved box asked for more weight than its reservation needs gets it,
//! `max(base, r_i K)`, and the excess must not eat into the others'
//! reservations), and the parent's own processes, counted as `N` busy
//! processes of the default weight. A margin of [`MARGIN`] covers the
//! imbalance of spreading few busy threads over the CPUs.
//!
//! The reservations are kept with the cgroups themselves, as the extended
//! attribute [`XATTR`] of each reserved box's directory (`"RESERVE BASE"`,
//! `BASE` the weight asked with `--cpu-shares`, or the default), so every
//! nestbox process sharing the parent (any root) sees them and they vanish
//! with the directories. The parent carries [`MARKER`] while any child is
//! reserved, so that a box start or removal under a parent without
//! reservations costs one `getxattr`. Weights are recomputed
//! ([`rebalance`]) under an exclusive `flock` of the parent directory
//! whenever a box cgroup is made or removed there; admission ([`admit`])
//! refuses reservations beyond [`RESERVABLE`] of the CPUs with a clear error.
//!
//! What this cannot promise: a sibling made by something other than nestbox
//! after the last rebalance is counted only at the next one; the parent's
//! own processes beyond `N` busy ones at nice 0; and a weight over the
//! kernel's maximum (262144 on v1, 10000 on v2) is cut to it. The guarantee
//! is relative to what the parent cgroup itself gets (relativity: a box
//! reserves part of its creator's CPU, not of the machine).

use std::fs;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

use crate::detect::Version;
use crate::error::{CgroupError, Op};
use crate::fsutil;

/// The attribute of a reserved box's directory: `"RESERVE BASE"`.
pub const XATTR: &str = "user.nestbox.cpu_reserve";
/// The attribute of a parent with at least one reserved child: `"1"`.
pub const MARKER: &str = "user.nestbox.cpu_reserved";
/// The fraction of the CPUs that reservations may take in all.
pub const RESERVABLE: f64 = 0.9;
/// Reserved weights are this much above the computed minimum.
pub const MARGIN: f64 = 1.25;

/// The weight file of a version, its default and bounds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scale {
    pub file: &'static str,
    pub default: u64,
    pub min: u64,
    pub max: u64,
}

/// v1 `cpu.shares` or v2 `cpu.weight`.
pub(crate) fn scale(version: Version) -> Scale {
    match version {
        Version::V1 => Scale {
            file: "cpu.shares",
            default: 1024,
            min: 2,
            max: 262_144,
        },
        Version::V2 => Scale {
            file: "cpu.weight",
            default: 100,
            min: 1,
            max: 10_000,
        },
    }
}

/// One child cgroup of the parent.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sibling {
    pub dir: PathBuf,
    /// Its current weight.
    pub weight: u64,
    /// Its reservation in CPUs and base weight, if it has one.
    pub reserve: Option<(f64, u64)>,
}

fn xattr_err(path: &Path, e: nix::errno::Errno) -> CgroupError {
    CgroupError::io(Op::Xattr, path, std::io::Error::from(e))
}

/// The reservation recorded on `dir`, if any.
fn recorded(dir: &Path) -> Result<Option<(f64, u64)>, CgroupError> {
    let Some(raw) = nestbox_sys::xattr::get(dir, XATTR).map_err(|e| xattr_err(dir, e))? else {
        return Ok(None);
    };
    let text = String::from_utf8_lossy(&raw);
    let mut parts = text.split_whitespace();
    let parsed = (|| Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?)))();
    match parsed {
        Some((r, base)) if f64::is_finite(r) && r > 0.0 => Ok(Some((r, base))),
        _ => Err(CgroupError::Parse {
            path: dir.to_path_buf(),
            content: text.into_owned(),
            reason: format!("attribute {XATTR}: expected \"CPUS WEIGHT\""),
        }),
    }
}

/// The child cgroups of `parent` with their weights and reservations.
/// Children without the weight file (another hierarchy's layout, or gone
/// meanwhile) are left out.
pub(crate) fn siblings(parent: &Path, scale: Scale) -> Result<Vec<Sibling>, CgroupError> {
    let mut out = Vec::new();
    let entries = fs::read_dir(parent).map_err(|e| CgroupError::io(Op::ReadDir, parent, e))?;
    for entry in entries.flatten() {
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let dir = entry.path();
        let Some(text) = fsutil::read_opt(&dir.join(scale.file))? else {
            continue;
        };
        // The kernel always fills the file; an empty one (a fake tree of the
        // unit tests) has the default.
        let weight = text.trim().parse::<u64>().unwrap_or(scale.default);
        // A sibling removed between the listing and here has no attribute.
        let reserve = match recorded(&dir) {
            Err(e) if e.is_not_found() => continue,
            other => other?,
        };
        out.push(Sibling {
            dir,
            weight,
            reserve,
        });
    }
    Ok(out)
}

/// The weights the reserved siblings need among `cpus` CPUs (pure; see the
/// module documentation), as (index in `sibs`, weight).
pub(crate) fn weights(cpus: f64, sibs: &[Sibling], scale: Scale) -> Vec<(usize, u64)> {
    let reserved: f64 = sibs.iter().filter_map(|s| s.reserve).map(|r| r.0).sum();
    // A reserved box's base weight (`--cpu-shares`) may exceed what its
    // reservation needs: counted as competition too, so that it cannot eat
    // into the others' reservations.
    let competing: u64 = sibs
        .iter()
        .map(|s| match s.reserve {
            None => s.weight,
            Some((_, base)) => base,
        })
        .sum::<u64>()
        + (scale.default as f64 * cpus).ceil() as u64;
    // Admission keeps at least (1 - RESERVABLE) of the CPUs free; a
    // reservation made by hand past it gets the largest weights.
    let free = (cpus - reserved).max(cpus * (1.0 - RESERVABLE) / 4.0);
    let k = competing as f64 / free;
    sibs.iter()
        .enumerate()
        .filter_map(|(i, s)| {
            let (r, base) = s.reserve?;
            let w = ((r * k * MARGIN).ceil() as u64)
                .max(base)
                .clamp(scale.min, scale.max);
            Some((i, w))
        })
        .collect()
}

/// An exclusive lock on the parent directory `parent` (held while the
/// reservations under it are checked or weighed).
fn lock(parent: &Path) -> Result<Flock<fs::File>, CgroupError> {
    let f = fs::File::open(parent).map_err(|e| CgroupError::io(Op::Lock, parent, e))?;
    Flock::lock(f, FlockArg::LockExclusive)
        .map_err(|(_, e)| CgroupError::io(Op::Lock, parent, std::io::Error::from(e)))
}

/// Refuse `wanted` CPUs when the reservations under `parent` plus it would
/// exceed [`RESERVABLE`] of `cpus`. Call with the parent locked.
fn admit(parent: &Path, scale: Scale, cpus: f64, wanted: f64) -> Result<(), CgroupError> {
    let reserved: f64 = siblings(parent, scale)?
        .iter()
        .filter_map(|s| s.reserve)
        .map(|r| r.0)
        .sum();
    let max = RESERVABLE * cpus;
    if reserved + wanted > max + 1e-9 {
        return Err(CgroupError::Overcommitted {
            wanted,
            reserved: round2(reserved),
            cpus,
            max: round2(max),
            parent: parent.to_path_buf(),
        });
    }
    Ok(())
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Write the weights the reserved children of `parent` need; drop the
/// parent's marker when none is left. Call with the parent locked.
fn rebalance_locked(parent: &Path, scale: Scale, cpus: f64) -> Result<(), CgroupError> {
    let sibs = siblings(parent, scale)?;
    if sibs.iter().all(|s| s.reserve.is_none()) {
        return nestbox_sys::xattr::remove(parent, MARKER).map_err(|e| xattr_err(parent, e));
    }
    for (i, w) in weights(cpus, &sibs, scale) {
        if sibs[i].weight != w {
            match fsutil::write(&sibs[i].dir.join(scale.file), &w.to_string()) {
                // Removed meanwhile: nothing to weigh.
                Err(e) if e.is_not_found() => {}
                other => other?,
            }
        }
    }
    Ok(())
}

/// Whether `parent` has reserved children (its marker is set).
fn marked(parent: &Path) -> bool {
    matches!(nestbox_sys::xattr::get(parent, MARKER), Ok(Some(_)))
}

/// After box directory `dir` (with the CPU controller) was made under
/// `parent`: record its reservation (`Some((cpus, base weight))`, admitted
/// first) and re-weigh the reserved siblings. Without a reservation this costs
/// one `getxattr` unless the parent has reserved children.
pub(crate) fn after_create(
    dir: &Path,
    version: Version,
    reserve: Option<(f64, u64)>,
    cpus: f64,
) -> Result<(), CgroupError> {
    let Some(parent) = dir.parent() else {
        return Ok(());
    };
    let scale = scale(version);
    match reserve {
        Some((r, base)) => {
            let _lock = lock(parent)?;
            admit(parent, scale, cpus, r)?;
            nestbox_sys::xattr::set(dir, XATTR, format!("{r} {base}").as_bytes())
                .map_err(|e| xattr_err(dir, e))?;
            nestbox_sys::xattr::set(parent, MARKER, b"1").map_err(|e| xattr_err(parent, e))?;
            rebalance_locked(parent, scale, cpus)
        }
        // A box without a reservation is made all the same when its
        // reserved siblings cannot be re-weighed (logged).
        None if marked(parent) => {
            let done = lock(parent).and_then(|_lock| rebalance_locked(parent, scale, cpus));
            if let Err(e) = done {
                tracing::warn!(
                    "re-weighing the CPU reservations under {}: {e}",
                    parent.display()
                );
            }
            Ok(())
        }
        None => Ok(()),
    }
}

/// After a box directory under `parent` was removed: re-weigh the reserved
/// children left (none: the marker goes). A failure is logged: the removal
/// itself succeeded.
pub(crate) fn after_remove(parent: &Path, version: Version, cpus: f64) {
    if !marked(parent) {
        return;
    }
    let done = lock(parent).and_then(|_lock| rebalance_locked(parent, scale(version), cpus));
    if let Err(e) = done {
        tracing::warn!(
            "re-weighing the CPU reservations under {}: {e}",
            parent.display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sib(weight: u64, reserve: Option<(f64, u64)>) -> Sibling {
        Sibling {
            dir: PathBuf::from("/x"),
            weight,
            reserve,
        }
    }

    /// The CPU share of sibling `i` when all are busy: its weight over the sum.
    fn share(cpus: f64, sibs: &[Sibling], scale: Scale, i: usize) -> f64 {
        let w = weights(cpus, sibs, scale);
        let weight_of = |j: usize| {
            w.iter()
                .find(|(k, _)| *k == j)
                .map_or(sibs[j].weight, |(_, x)| *x)
        };
        let parent_tasks = scale.default as f64 * cpus;
        let total: f64 = (0..sibs.len()).map(|j| weight_of(j) as f64).sum::<f64>() + parent_tasks;
        weight_of(i) as f64 / total * cpus
    }

    #[test]
    fn a_reservation_holds_against_heavier_siblings() {
        for version in [Version::V1, Version::V2] {
            let s = scale(version);
            let sibs = vec![
                sib(s.default, Some((0.5, s.default))),
                sib(s.default * 4, None),
                sib(s.default * 4, None),
                sib(s.default * 4, None),
                sib(s.default * 4, None),
            ];
            let got = share(2.0, &sibs, s, 0);
            assert!(got >= 0.5, "{version:?}: {got}");
        }
    }

    #[test]
    fn several_reservations_each_hold_and_a_larger_base_weight_is_kept() {
        let s = scale(Version::V1);
        let mut sibs = vec![
            sib(1024, Some((0.5, 1024))),
            sib(1024, Some((0.1, 200_000))),
        ];
        sibs.extend((0..20).map(|_| sib(2048, None)));
        let w = weights(2.0, &sibs, s);
        assert_eq!(w.len(), 2);
        assert_eq!(w[1].1, 200_000);
        assert!(share(2.0, &sibs, s, 0) >= 0.5);
        assert!(share(2.0, &sibs, s, 1) >= 0.1);
    }

    #[test]
    fn weights_stay_within_the_kernel_bounds() {
        let s = scale(Version::V2);
        let mut sibs = vec![sib(100, Some((1.5, 100)))];
        sibs.extend((0..500).map(|_| sib(10_000, None)));
        assert_eq!(weights(2.0, &sibs, s), vec![(0, 10_000)]);
    }
}
