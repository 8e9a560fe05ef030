//! cgroup v2 control-file writes: enabling controllers in the parent's
//! `cgroup.subtree_control`, limits, freezing and `cgroup.kill`.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use crate::error::{CgroupError, CgroupWarning};
use crate::fsutil;
use crate::limits::{shares_to_weight, Limits};

/// The v2 controllers a box uses, in the order they are enabled (hugetlb
/// only for a box with hugepage limits).
pub(crate) const CONTROLLERS: &[&str] = &["cpu", "cpuset", "io", "memory", "pids", "hugetlb"];

/// Maps a v1 controller name to its v2 name (`blkio` is `io`).
pub(crate) fn v2_name(v1: &str) -> &str {
    match v1 {
        "blkio" => "io",
        other => other,
    }
}

/// The controllers listed in `dir/cgroup.controllers` (`None` if missing).
pub(crate) fn available(dir: &Path) -> Result<Option<BTreeSet<String>>, CgroupError> {
    Ok(fsutil::read_opt(&dir.join("cgroup.controllers"))?
        .map(|s| s.split_whitespace().map(str::to_string).collect()))
}

/// Makes sure every controller in `wanted` is enabled in the
/// `cgroup.subtree_control` of every cgroup from `top` down to `parent`
/// (both included; `parent` must be `top` or below it), so that `parent`'s
/// children get them, as runc does on its cgroup's path: each ancestor must
/// enable a controller for the cgroup below it to have it. Returns what
/// [`enable_controllers`] returns for `parent`. An ancestor that cannot
/// enable a controller (one with processes of its own, or that is not
/// delegated it) fails the call when the controller is `required`; an
/// optional one is left to `parent`'s step (then a warning).
pub(crate) fn enable_along(
    top: &Path,
    parent: &Path,
    wanted: &[&str],
    required: &BTreeSet<&str>,
    warnings: &mut Vec<CgroupWarning>,
) -> Result<Vec<String>, CgroupError> {
    let mut above: Vec<&Path> = parent
        .ancestors()
        .skip(1)
        .take_while(|a| a.starts_with(top))
        .collect();
    above.reverse();
    for dir in above {
        let file = dir.join("cgroup.subtree_control");
        let current: BTreeSet<String> = fsutil::read(&file)?
            .split_whitespace()
            .map(|c| c.trim_start_matches('+').to_string())
            .collect();
        for c in wanted.iter().filter(|c| !current.contains(**c)) {
            if let Err(e) = fsutil::write_with_hint(&file, &format!("+{c}"), Some(HINT)) {
                if required.contains(c) {
                    return Err(e);
                }
            }
        }
    }
    enable_controllers(parent, wanted, required, warnings)
}

/// Why a controller may not be enabled in a v2 cgroup.
const HINT: &str = "cgroup v2 allows enabling controllers only in a cgroup without processes of its own \
                    (the 'no internal processes' rule) and only if the parent delegates them; run from a \
                    delegated cgroup";

/// Makes sure every controller in `wanted` is enabled in
/// `parent/cgroup.subtree_control`. Returns the controllers that are
/// enabled. A controller that cannot be enabled is an error when it is in
/// `required`, else it becomes a warning.
pub(crate) fn enable_controllers(
    parent: &Path,
    wanted: &[&str],
    required: &BTreeSet<&str>,
    warnings: &mut Vec<CgroupWarning>,
) -> Result<Vec<String>, CgroupError> {
    let file = parent.join("cgroup.subtree_control");
    let current: BTreeSet<String> = fsutil::read(&file)?
        .split_whitespace()
        .map(|c| c.trim_start_matches('+').to_string())
        .collect();
    let mut enabled: Vec<String> = Vec::new();
    let mut missing: Vec<&str> = Vec::new();
    for c in wanted {
        if current.contains(*c) {
            enabled.push((*c).to_string());
        } else {
            missing.push(c);
        }
    }
    if missing.is_empty() {
        return Ok(enabled);
    }
    let hint = HINT;
    let all: Vec<String> = missing.iter().map(|c| format!("+{c}")).collect();
    if fsutil::write(&file, &all.join(" ")).is_ok() {
        enabled.extend(missing.iter().map(|c| c.to_string()));
    } else {
        // Find out which ones fail.
        for c in missing {
            match fsutil::write_with_hint(&file, &format!("+{c}"), Some(hint)) {
                Ok(()) => enabled.push(c.to_string()),
                Err(e) if required.contains(c) => return Err(e),
                Err(e) => warnings.push(CgroupWarning::ControllerNotEnabled {
                    controller: c.to_string(),
                    path: file.clone(),
                    reason: e.to_string(),
                }),
            }
        }
    }
    enabled.sort();
    Ok(enabled)
}

/// Writes `limits` into the new v2 box directory `dir`, in which
/// `controllers` are enabled.
pub(crate) fn apply(
    dir: &Path,
    controllers: &[String],
    limits: &Limits,
) -> Result<(), CgroupError> {
    let has = |c: &str| controllers.iter().any(|x| x == c);
    if has("cpuset") {
        if let Some(cpus) = &limits.cpuset_cpus {
            fsutil::write(&dir.join("cpuset.cpus"), cpus)?;
        }
    }
    if has("memory") {
        if limits.memory_swappiness.is_some() {
            return Err(CgroupError::Unsupported {
                option: "memory_swappiness",
                reason: "cgroup v2 has no per-cgroup swappiness".into(),
            });
        }
        if limits.oom_kill_disable {
            return Err(CgroupError::Unsupported {
                option: "oom_kill_disable",
                reason: "cgroup v2 cannot keep the OOM killer from a cgroup".into(),
            });
        }
        if let Some(m) = limits.memory {
            fsutil::write(&dir.join("memory.max"), &m.to_string())?;
        }
        if let Some(r) = limits.memory_reserve {
            fsutil::write(&dir.join("memory.low"), &r.to_string())?;
        }
        if let Some(swap) = limits.memory_swap {
            let file = dir.join("memory.swap.max");
            if !file.exists() {
                return Err(CgroupError::Unsupported {
                    option: "memory_swap",
                    reason: format!(
                        "the kernel has no swap accounting ({} is missing)",
                        file.display()
                    ),
                });
            }
            let value = if swap == -1 {
                "max".to_string()
            } else {
                let mem = limits.memory.unwrap_or(0) as i64;
                (swap - mem).max(0).to_string()
            };
            fsutil::write(&file, &value)?;
        }
    }
    if has("cpu") {
        if let Some(quota) = limits.cfs_quota_us() {
            fsutil::write(
                &dir.join("cpu.max"),
                &format!("{quota} {}", limits.cfs_period_us()),
            )?;
        }
        if let Some(shares) = limits.cpu_shares {
            fsutil::write(
                &dir.join("cpu.weight"),
                &shares_to_weight(shares).to_string(),
            )?;
        }
    }
    if has("pids") {
        if let Some(p) = limits.pids {
            fsutil::write(&dir.join("pids.max"), &p.to_string())?;
        }
    }
    if has("hugetlb") {
        for h in &limits.hugepage_limits {
            fsutil::write_hugetlb(dir, &h.page_size, h.limit, "max")?;
        }
    }
    if has("io") {
        if let Some(w) = limits.io_weight {
            let weight = dir.join("io.weight");
            let bfq = dir.join("io.bfq.weight");
            if weight.exists() {
                fsutil::write(&weight, &format!("default {w}"))?;
            } else if bfq.exists() {
                fsutil::write(&bfq, &w.to_string())?;
            } else {
                return Err(CgroupError::Unsupported {
                    option: "io_weight",
                    reason: format!(
                        "the kernel's io controller offers no weight file (neither io.weight nor io.bfq.weight in {}); io_weight={w} cannot be applied",
                        dir.display()
                    ),
                });
            }
        }
        for d in &limits.io_devices {
            let dev = d.device();
            if let Some(w) = d.weight {
                let file = fsutil::first_present(dir, &["io.weight", "io.bfq.weight"])
                .ok_or_else(|| CgroupError::Unsupported {
                        option: "io_devices",
                        reason: format!(
                            "the kernel's io controller offers no weight file (neither io.weight nor io.bfq.weight in {}); weight {w} of {dev} cannot be applied",
                            dir.display()
                        ),
                    })?;
                fsutil::write(&file, &format!("{dev} {w}"))?;
            }
            let max: Vec<String> = [
                (d.read_bps, "rbps"),
                (d.write_bps, "wbps"),
                (d.read_iops, "riops"),
                (d.write_iops, "wiops"),
            ]
            .iter()
            .filter_map(|(v, k)| v.map(|v| format!("{k}={v}")))
            .collect();
            if !max.is_empty() {
                fsutil::write(&dir.join("io.max"), &format!("{dev} {}", max.join(" ")))?;
            }
        }
    }
    Ok(())
}

/// Reads the `frozen` key of `cgroup.events`.
fn is_frozen(dir: &Path) -> Result<Option<bool>, CgroupError> {
    let text = fsutil::read(&dir.join("cgroup.events"))?;
    Ok(crate::stats::keyed(&text, "frozen").map(|v| v == 1))
}

/// Freezes or thaws the v2 cgroup `dir` with `cgroup.freeze` and waits for
/// `cgroup.events` to report it. On a freeze timeout the cgroup is thawed
/// again and an error returned.
pub(crate) fn set_frozen(dir: &Path, frozen: bool, timeout: Duration) -> Result<(), CgroupError> {
    let file = dir.join("cgroup.freeze");
    // A cgroup that is gone is not a kernel without the freezer: the write
    // below then fails with ENOENT, which callers can tell apart.
    if !file.exists() && dir.is_dir() {
        return Err(CgroupError::Unsupported {
            option: "freeze",
            reason: format!(
                "{} is missing (cgroup v2 freezing needs Linux 5.2)",
                file.display()
            ),
        });
    }
    fsutil::write(&file, if frozen { "1" } else { "0" })?;
    let done = fsutil::poll_until(timeout, crate::v1::FREEZER_POLL, |_| {
        Ok(is_frozen(dir)? == Some(frozen))
    })?;
    if done {
        return Ok(());
    }
    if frozen {
        // The timeout is what is reported; a freeze the undo could not lift
        // is logged, and the caller's thaw or kill_all meets it again.
        if let Err(e) = fsutil::write(&file, "0") {
            tracing::warn!("undoing a freeze that timed out: {e}");
        }
    }
    Err(CgroupError::Timeout {
        what: format!("\"frozen {}\" in cgroup.events", u8::from(frozen)),
        path: dir.to_path_buf(),
        waited: timeout,
    })
}

/// Kills every process of `dir` with `cgroup.kill`. Returns `false` when the
/// kernel has no `cgroup.kill` (before Linux 5.14).
pub(crate) fn kill(dir: &Path) -> Result<bool, CgroupError> {
    let file = dir.join("cgroup.kill");
    if !file.exists() {
        return Ok(false);
    }
    fsutil::write(&file, "1")?;
    Ok(true)
}
