//! cgroup v1 control-file writes: limits, device rules, cpuset
//! initialisation and the freezer.
//!
//! Each function works on one box directory of one v1 hierarchy and only
//! touches the controllers that hierarchy carries, so co-mounted hierarchies
//! (`cpu,cpuacct`) and separate ones are handled alike.

use std::path::Path;
use std::time::Duration;

use crate::error::CgroupError;
use crate::fsutil;
use crate::limits::Limits;

/// The device rules of a box on v1: deny everything (`a`), then allow these
/// (written one at a time to `devices.allow`). The standard container set:
/// null, zero, full, random, urandom, tty, ptmx, the pts devices, and
/// `mknod` of any device node.
pub const DEFAULT_DEVICE_RULES: &[&str] = &[
    "c 1:3 rwm",
    "c 1:5 rwm",
    "c 1:7 rwm",
    "c 1:8 rwm",
    "c 1:9 rwm",
    "c 5:0 rwm",
    "c 5:2 rwm",
    "c 136:* rwm",
    "c *:* m",
    "b *:* m",
];

/// The largest CFS quota per `period` microseconds that v1 lets a cgroup
/// below `parent` have: the smallest share (quota / period) that `parent` or
/// an ancestor of it in the same hierarchy is capped at; `None` when none is
/// capped (quota -1) or the files cannot be read.
pub(crate) fn cfs_ceiling(parent: &Path, period: u64) -> Option<u64> {
    let mut share: Option<f64> = None;
    let mut at = Some(parent);
    while let Some(dir) = at {
        let quota = fsutil::read_opt(&dir.join("cpu.cfs_quota_us"))
            .ok()
            .flatten();
        let Some(quota) = quota else {
            // Above the hierarchy's root directory (or not a cpu hierarchy).
            break;
        };
        let their_period = fsutil::read_opt(&dir.join("cpu.cfs_period_us"))
            .ok()
            .flatten()
            .and_then(|p| p.trim().parse::<u64>().ok())
            .filter(|p| *p > 0);
        if let (Ok(q), Some(p)) = (quota.trim().parse::<i64>(), their_period) {
            if q > 0 {
                let s = q as f64 / p as f64;
                share = Some(share.map_or(s, |m: f64| m.min(s)));
            }
        }
        at = dir.parent();
    }
    share.map(|s| (s * period as f64).floor() as u64)
}

/// Writes `limits` (and, for a new directory, the cpuset/devices set-up
/// every box needs) into the box directory `dir` of a hierarchy carrying
/// `controllers`; `parent` is its parent cgroup. Without `new` (an update of
/// a running box) only the limits given are written.
pub(crate) fn apply(
    dir: &Path,
    parent: &Path,
    controllers: &[String],
    limits: &Limits,
    new: bool,
) -> Result<(), CgroupError> {
    let has = |c: &str| controllers.iter().any(|x| x == c);
    if has("cpuset") {
        if new {
            init_cpuset(dir, parent)?;
        }
        if let Some(cpus) = &limits.cpuset_cpus {
            fsutil::write(&dir.join("cpuset.cpus"), cpus)?;
        }
    }
    if has("memory") {
        apply_memory(dir, limits)?;
    }
    if has("cpu") {
        if let Some(asked) = limits.cfs_quota_us() {
            let period = limits.cfs_period_us();
            // v1 refuses a quota above what an ancestor allows (EINVAL); v2
            // takes it and bounds the box by the ancestor anyway. Both ways
            // the box gets at most its parent's share: written as that here.
            let quota = match cfs_ceiling(parent, period) {
                Some(ceiling) if asked > ceiling => {
                    tracing::warn!(
                        cgroup = %dir.display(),
                        "a CPU cap of {asked} us per {period} us is more than an enclosing cgroup allows: capped at {ceiling} us"
                    );
                    ceiling
                }
                _ => asked,
            };
            fsutil::write(&dir.join("cpu.cfs_period_us"), &period.to_string())?;
            fsutil::write(&dir.join("cpu.cfs_quota_us"), &quota.to_string())?;
        }
        if let Some(shares) = limits.cpu_shares {
            fsutil::write(&dir.join("cpu.shares"), &shares.to_string())?;
        }
    }
    if has("pids") {
        if let Some(p) = limits.pids {
            fsutil::write(&dir.join("pids.max"), &p.to_string())?;
        }
    }
    if has("blkio") {
        if let Some(w) = limits.io_weight {
            apply_blkio_weight(dir, w)?;
        }
        apply_blkio_devices(dir, &limits.io_devices)?;
    }
    if has("net_cls") {
        if let Some(id) = limits.net_class_id {
            fsutil::write(&dir.join("net_cls.classid"), &id.to_string())?;
        }
    }
    if has("net_prio") {
        for p in &limits.net_priorities {
            fsutil::write(
                &dir.join("net_prio.ifpriomap"),
                &format!("{} {}", p.interface, p.priority),
            )?;
        }
    }
    if has("hugetlb") {
        for h in &limits.hugepage_limits {
            crate::fsutil::write_hugetlb(dir, &h.page_size, h.limit, "limit_in_bytes")?;
        }
    }
    if has("devices") && new {
        apply_devices(dir)?;
    }
    Ok(())
}

/// A new v1 cpuset cgroup starts with empty `cpuset.cpus`/`cpuset.mems`,
/// and no process can join it until they are set: copy the parent's values.
pub(crate) fn init_cpuset(dir: &Path, parent: &Path) -> Result<(), CgroupError> {
    for (file, effective) in [
        ("cpuset.cpus", "cpuset.effective_cpus"),
        ("cpuset.mems", "cpuset.effective_mems"),
    ] {
        let mut value = fsutil::read(&parent.join(file))?.trim().to_string();
        if value.is_empty() {
            if let Some(eff) = fsutil::read_opt(&parent.join(effective))? {
                value = eff.trim().to_string();
            }
        }
        if value.is_empty() {
            return Err(CgroupError::Unsupported {
                option: "cpuset",
                reason: format!(
                    "the parent cgroup {} has an empty {file}; cannot initialise the box's cpuset",
                    parent.display()
                ),
            });
        }
        fsutil::write(&dir.join(file), &value)?;
    }
    Ok(())
}

fn apply_memory(dir: &Path, limits: &Limits) -> Result<(), CgroupError> {
    if let Some(m) = limits.memory {
        fsutil::write(&dir.join("memory.limit_in_bytes"), &m.to_string())?;
    }
    if let Some(r) = limits.memory_reserve {
        fsutil::write(&dir.join("memory.soft_limit_in_bytes"), &r.to_string())?;
    }
    if let Some(swap) = limits.memory_swap {
        let file = dir.join("memory.memsw.limit_in_bytes");
        if !file.exists() {
            return Err(CgroupError::Unsupported {
                option: "memory_swap",
                reason: format!(
                    "the kernel has no swap accounting ({} is missing; boot with swapaccount=1)",
                    file.display()
                ),
            });
        }
        // memsw must stay >= limit_in_bytes: the memory limit is written first.
        fsutil::write(&file, &swap.to_string())?;
    }
    if let Some(s) = limits.memory_swappiness {
        fsutil::write(&dir.join("memory.swappiness"), &s.to_string())?;
    }
    if limits.oom_kill_disable {
        fsutil::write(&dir.join("memory.oom_control"), "1")?;
    }
    Ok(())
}

fn apply_blkio_weight(dir: &Path, weight: u16) -> Result<(), CgroupError> {
    for name in ["blkio.weight", "blkio.bfq.weight"] {
        let file = dir.join(name);
        if file.exists() {
            return fsutil::write(&file, &weight.to_string());
        }
    }
    Err(CgroupError::Unsupported {
        option: "io_weight",
        reason: format!(
            "the kernel's blkio controller offers no weight file (neither blkio.weight nor blkio.bfq.weight in {}); io_weight={weight} cannot be applied",
            dir.display()
        ),
    })
}

/// The per-device weights and throttles of `devices` in the v1 blkio
/// cgroup `dir`.
fn apply_blkio_devices(
    dir: &Path,
    devices: &[crate::limits::IoDeviceLimit],
) -> Result<(), CgroupError> {
    for d in devices {
        let dev = d.device();
        if let Some(w) = d.weight {
            let file = fsutil::first_present(dir, &["blkio.weight_device", "blkio.bfq.weight_device"])
                .ok_or_else(|| CgroupError::Unsupported {
                    option: "io_devices",
                    reason: format!(
                        "the kernel's blkio controller offers no per-device weight file (neither blkio.weight_device nor blkio.bfq.weight_device in {}); weight {w} of {dev} cannot be applied",
                        dir.display()
                    ),
                })?;
            fsutil::write(&file, &format!("{dev} {w}"))?;
        }
        for (value, name) in [
            (d.read_bps, "blkio.throttle.read_bps_device"),
            (d.write_bps, "blkio.throttle.write_bps_device"),
            (d.read_iops, "blkio.throttle.read_iops_device"),
            (d.write_iops, "blkio.throttle.write_iops_device"),
        ] {
            if let Some(v) = value {
                fsutil::write(&dir.join(name), &format!("{dev} {v}"))?;
            }
        }
    }
    Ok(())
}

/// Replaces the device rules of the v1 devices cgroup `dir`: deny every
/// device, then write each rule in order (`devices.allow` or
/// `devices.deny`), so a later rule overrides an earlier one.
pub(crate) fn set_device_rules(dir: &Path, rules: &[crate::DeviceRule]) -> Result<(), CgroupError> {
    fsutil::write(&dir.join("devices.deny"), "a")?;
    for rule in rules {
        let file = dir.join(if rule.allow {
            "devices.allow"
        } else {
            "devices.deny"
        });
        fsutil::write_with_hint(
            &file,
            &rule.v1_text(),
            Some("a v1 devices cgroup can only allow what its parent allows"),
        )?;
    }
    Ok(())
}

fn apply_devices(dir: &Path) -> Result<(), CgroupError> {
    fsutil::write(&dir.join("devices.deny"), "a")?;
    let allow = dir.join("devices.allow");
    for rule in DEFAULT_DEVICE_RULES {
        fsutil::write_with_hint(
            &allow,
            rule,
            Some("a v1 devices cgroup can only allow what its parent allows"),
        )?;
    }
    Ok(())
}

/// Freezes (`frozen`) or thaws the v1 freezer cgroup `dir` and waits until
/// `freezer.state` reports the new state. Freezing is retried by rewriting
/// the state; on timeout a freeze is undone (thawed) and an error returned.
/// How often the freezer state is polled while it changes.
pub(crate) const FREEZER_POLL: Duration = Duration::from_micros(200);

pub(crate) fn set_frozen(dir: &Path, frozen: bool, timeout: Duration) -> Result<(), CgroupError> {
    let file = dir.join("freezer.state");
    let want = if frozen { "FROZEN" } else { "THAWED" };
    fsutil::write(&file, want)?;
    // Freezing usually completes within a millisecond: poll finely, and repeat
    // the request every ~100 ms (a task that was forking can make one attempt
    // stall in FREEZING).
    let done = fsutil::poll_until(timeout, FREEZER_POLL, |round| {
        if round > 0 && round % 500 == 0 {
            fsutil::write(&file, want)?;
        }
        Ok(fsutil::read(&file)?.trim() == want)
    })?;
    if done {
        return Ok(());
    }
    if frozen {
        // As in v2: the timeout is reported, a failed undo logged.
        if let Err(e) = fsutil::write(&file, "THAWED") {
            tracing::warn!("undoing a freeze that timed out: {e}");
        }
    }
    Err(CgroupError::Timeout {
        what: format!("freezer.state {want}"),
        path: dir.to_path_buf(),
        waited: timeout,
    })
}
