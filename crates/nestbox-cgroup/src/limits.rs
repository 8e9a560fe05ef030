//! Resource limits of a box, their validation and unit conversions.
//!
//! [`Limits`] is the version-independent description of what a box may use;
//! `v1.rs` and `v2.rs` translate it into control-file writes. Validation
//! happens before anything is created: [`Limits::validate`] checks values on
//! their own, [`Limits::validate_against`] additionally checks the cpuset
//! against the parent cgroup.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::detect::{Hierarchies, Version};
use crate::error::CgroupError;
use crate::fsutil;

/// CFS period used for CPU caps, in microseconds (`cpu.cfs_period_us`, the
/// second field of `cpu.max`).
pub const CFS_PERIOD_US: u64 = 100_000;
/// The smallest CFS quota the kernel accepts, in microseconds.
pub const MIN_CFS_QUOTA_US: u64 = 1_000;
/// Bounds of v1 `cpu.shares`.
pub const CPU_SHARES_RANGE: std::ops::RangeInclusive<u64> = 2..=262_144;
/// Bounds of the I/O weight.
pub const IO_WEIGHT_RANGE: std::ops::RangeInclusive<u16> = 10..=1000;
/// Largest CPU number accepted in a CPU list.
const MAX_CPU: u32 = 65_535;

/// Resource limits of a box. `None` means "not limited".
#[derive(Serialize, Deserialize, Default, Clone, Debug, PartialEq)]
#[serde(default)]
pub struct Limits {
    /// Memory limit in bytes: v1 `memory.limit_in_bytes`, v2 `memory.max`.
    pub memory: Option<u64>,
    /// Docker semantics: memory + swap in bytes, `-1` for unlimited swap.
    /// Needs `memory`. v1 `memory.memsw.limit_in_bytes` (needs swap
    /// accounting), v2 `memory.swap.max` = `memory_swap - memory`.
    /// When unset, swap is left as the kernel default.
    pub memory_swap: Option<i64>,
    /// Memory reserved for the box in bytes: the kernel reclaims from it last
    /// (v1 `memory.soft_limit_in_bytes`, v2 `memory.low`), and the overload
    /// watchdog stops boxes by how far they are above it.
    #[serde(default)]
    pub memory_reserve: Option<u64>,
    /// Maximum number of tasks: `pids.max`.
    pub pids: Option<u64>,
    /// Hard cap in CPUs (e.g. `0.5`): v1 `cpu.cfs_quota_us` with a
    /// [`CFS_PERIOD_US`] period, v2 `cpu.max`.
    pub cpus: Option<f64>,
    /// CFS period in microseconds for `cpus` (1000 to 1000000; default
    /// [`CFS_PERIOD_US`]): the quota is `cpus` × this period.
    #[serde(default)]
    pub cpu_period_us: Option<u64>,
    /// Relative CPU weight: v1 `cpu.shares`, v2 `cpu.weight` converted with
    /// [`shares_to_weight`].
    pub cpu_shares: Option<u64>,
    /// CPUs guaranteed to the box whenever it wants them (e.g. `0.5`): its
    /// weight (v1 `cpu.shares`, v2 `cpu.weight`) is kept high enough against
    /// its siblings' (see [`crate::reserve`]). Admitted while all reservations
    /// under the parent fit in [`crate::reserve::RESERVABLE`] of the CPUs.
    #[serde(default)]
    pub cpu_reserve: Option<f64>,
    /// CPUs the box may run on, kernel list syntax (`"0-2,4"`).
    pub cpuset_cpus: Option<String>,
    /// I/O weight 10..=1000: v2 `io.weight`, v1 `blkio.weight` or
    /// `blkio.bfq.weight`.
    pub io_weight: Option<u16>,
    /// How eagerly the kernel swaps the box's anonymous memory, 0..=100:
    /// v1 `memory.swappiness` (cgroup v2 has no per-cgroup value: refused
    /// there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_swappiness: Option<u64>,
    /// The OOM killer leaves the box's processes alone: at its memory limit
    /// they wait for memory instead (v1 `memory.oom_control` = 1; cgroup v2
    /// has no such switch: refused there).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub oom_kill_disable: bool,
    /// Per-device I/O limits (the OCI config's `blockIO.weightDevice` and
    /// `throttle*Device`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub io_devices: Vec<IoDeviceLimit>,
    /// Class id tagged on the box's network packets: v1 `net_cls.classid`
    /// (cgroup v2 has no net_cls: refused there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net_class_id: Option<u32>,
    /// Priority of the box's traffic per interface: v1 `net_prio.ifpriomap`
    /// (cgroup v2 has no net_prio: refused there).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub net_priorities: Vec<NetPriority>,
    /// Huge pages the box may use, per page size (the OCI config's
    /// `hugepageLimits`): v1 `hugetlb.<size>.limit_in_bytes`, v2
    /// `hugetlb.<size>.max`, and their `rsvd` variants where the kernel has
    /// them. The hugetlb controller is used only for a box that asks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hugepage_limits: Vec<HugepageLimit>,
}

/// A limit on the huge pages of one size.
#[derive(Serialize, Deserialize, Default, Clone, Debug, PartialEq, Eq)]
pub struct HugepageLimit {
    /// The page size as the kernel names it in its hugetlb files (`64KB`,
    /// `2MB`, `1GB`: see [`hugepage_size_name`]).
    pub page_size: String,
    /// Bytes of huge pages of that size.
    pub limit: u64,
}

/// Where the kernel lists its huge page sizes (`hugepages-2048kB`, …).
pub const HUGEPAGES_SYSFS: &str = "/sys/kernel/mm/hugepages";

/// The kernel's name of a huge page size (as its hugetlb cgroup files spell
/// it: `2MB`, `1GB`, `64KB`; mm/hugetlb_cgroup.c) given as `<n>KB`, `<n>MB`,
/// `<n>GB` or `<n>TB` (case of the unit ignored; `2048KB` is `2MB`).
///
/// # Errors
/// Not of that form, zero, or not a whole number of KiB.
pub fn hugepage_size_name(given: &str) -> Result<String, CgroupError> {
    let bad = |reason: &str| invalid("hugepage_limits", format!("page size {given:?}"), reason);
    let upper = given.trim().to_ascii_uppercase();
    let digits = upper.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let unit = &upper[digits.len()..];
    let scale: u64 = match unit {
        "KB" => 1 << 10,
        "MB" => 1 << 20,
        "GB" => 1 << 30,
        "TB" => 1 << 40,
        _ => return Err(bad("is not <number>KB, MB or GB (as 2MB, 1GB)")),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| bad("is not <number>KB, MB or GB (as 2MB, 1GB)"))?;
    let bytes = n
        .checked_mul(scale)
        .filter(|b| *b > 0)
        .ok_or_else(|| bad("is zero or too large"))?;
    Ok(hugepage_name_of_bytes(bytes))
}

/// The kernel's name of a huge page of `bytes` (mem_fmt of
/// mm/hugetlb_cgroup.c).
fn hugepage_name_of_bytes(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{}GB", bytes >> 30)
    } else if bytes >= 1 << 20 {
        format!("{}MB", bytes >> 20)
    } else {
        format!("{}KB", bytes >> 10)
    }
}

/// The huge page sizes the kernel has, by the kernel's names, from
/// `sysfs` ([`HUGEPAGES_SYSFS`]: one `hugepages-<n>kB` directory each),
/// largest first. Empty when the kernel has none (or no such directory).
pub fn kernel_hugepage_sizes(sysfs: &Path) -> Vec<String> {
    let mut sizes: Vec<u64> = std::fs::read_dir(sysfs)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let kb: u64 = name
                .to_str()?
                .strip_prefix("hugepages-")?
                .strip_suffix("kB")?
                .parse()
                .ok()?;
            Some(kb << 10)
        })
        .collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes.into_iter().map(hugepage_name_of_bytes).collect()
}

/// The priority of a box's traffic on one network interface.
#[derive(Serialize, Deserialize, Default, Clone, Debug, PartialEq, Eq)]
pub struct NetPriority {
    /// The interface's name.
    pub interface: String,
    /// The priority.
    pub priority: u32,
}

/// The I/O limits of one block device `major:minor`: v1
/// `blkio.weight_device` (or `blkio.bfq.weight_device`) and
/// `blkio.throttle.{read,write}_{bps,iops}_device`; v2 `io.weight` (or
/// `io.bfq.weight`) and `io.max`.
#[derive(Serialize, Deserialize, Default, Clone, Debug, PartialEq, Eq)]
pub struct IoDeviceLimit {
    /// The device's major number.
    pub major: u32,
    /// The device's minor number.
    pub minor: u32,
    /// Its weight, 10..=1000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u16>,
    /// Read bytes per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_bps: Option<u64>,
    /// Written bytes per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_bps: Option<u64>,
    /// Read operations per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_iops: Option<u64>,
    /// Write operations per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_iops: Option<u64>,
}

impl IoDeviceLimit {
    /// `major:minor`, as the cgroup files name a device.
    pub fn device(&self) -> String {
        format!("{}:{}", self.major, self.minor)
    }
}

/// Converts v1 `cpu.shares` to v2 `cpu.weight` the way runc and crun do:
/// `1 + ((shares - 2) * 9999) / 262142`.
pub fn shares_to_weight(shares: u64) -> u64 {
    let shares = shares.clamp(*CPU_SHARES_RANGE.start(), *CPU_SHARES_RANGE.end());
    1 + ((shares - 2) * 9999) / 262_142
}

/// Number of online CPUs: `/sys/devices/system/cpu/online`, else
/// [`std::thread::available_parallelism`].
pub fn online_cpus() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| parse_cpu_list(&s).ok())
        .map(|v| v.len())
        .filter(|n| *n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Parses a kernel CPU list such as `"0-2,4"` (whitespace around it is
/// ignored) into sorted, de-duplicated CPU numbers. The empty list gives an
/// empty vector.
pub fn parse_cpu_list(s: &str) -> Result<Vec<u32>, CgroupError> {
    let err = |reason: String| CgroupError::CpuList {
        value: s.to_string(),
        reason,
    };
    let num = |t: &str| -> Result<u32, CgroupError> {
        if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err(format!("{t:?} is not a CPU number")));
        }
        let n: u32 = t
            .parse()
            .map_err(|_| err(format!("{t:?} is not a CPU number")))?;
        if n > MAX_CPU {
            return Err(err(format!("CPU {n} is out of range (max {MAX_CPU})")));
        }
        Ok(n)
    };
    let trimmed = s.trim();
    let mut out = Vec::new();
    if trimmed.is_empty() {
        return Ok(out);
    }
    for part in trimmed.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    return Err(err(format!("range {part:?} is reversed")));
                }
                out.extend(a..=b);
            }
            None => out.push(num(part)?),
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

fn invalid(option: &'static str, value: impl ToString, reason: impl Into<String>) -> CgroupError {
    CgroupError::InvalidLimit {
        option,
        value: value.to_string(),
        reason: reason.into(),
    }
}

impl Limits {
    /// True when no limit is set.
    pub fn is_empty(&self) -> bool {
        *self == Limits::default()
    }

    /// Checks every value on its own (ranges, syntax, CPUs online). Call it
    /// before creating anything; [`crate::BoxCgroup::create`] calls it too.
    pub fn validate(&self) -> Result<(), CgroupError> {
        self.validate_with_online(online_cpus())
    }

    pub(crate) fn validate_with_online(&self, online: usize) -> Result<(), CgroupError> {
        if let Some(m) = self.memory {
            if m == 0 {
                return Err(invalid("memory", m, "must be > 0 bytes"));
            }
        }
        if let Some(s) = self.memory_swap {
            match self.memory {
                None => {
                    return Err(invalid(
                        "memory_swap",
                        s,
                        "needs memory to be set too (memory_swap is memory + swap)",
                    ))
                }
                Some(_) if s == -1 => {}
                Some(_) if s < 0 => {
                    return Err(invalid(
                        "memory_swap",
                        s,
                        "must be -1 (unlimited) or >= memory",
                    ))
                }
                Some(m) if (s as u64) < m => {
                    return Err(invalid(
                        "memory_swap",
                        s,
                        format!("must be >= memory ({m}) since it is memory + swap"),
                    ))
                }
                Some(_) => {}
            }
        }
        if let (Some(r), Some(m)) = (self.memory_reserve, self.memory) {
            if r > m {
                return Err(invalid(
                    "memory_reserve",
                    r,
                    format!(
                        "must be <= memory ({m}): a box cannot be guaranteed more than it may use"
                    ),
                ));
            }
        }
        if let Some(p) = self.pids {
            if p < 1 {
                return Err(invalid("pids", p, "must be >= 1"));
            }
        }
        if let Some(c) = self.cpus {
            if !c.is_finite() || c <= 0.0 || c > online as f64 {
                return Err(invalid(
                    "cpus",
                    c,
                    format!("must be > 0 and <= {online} (online CPUs)"),
                ));
            }
            if self.cfs_quota_us().unwrap_or(0) < MIN_CFS_QUOTA_US {
                return Err(invalid(
                    "cpus",
                    c,
                    format!(
                        "must be >= {} (the kernel's minimum CFS quota is {MIN_CFS_QUOTA_US}us per {CFS_PERIOD_US}us)",
                        MIN_CFS_QUOTA_US as f64 / CFS_PERIOD_US as f64
                    ),
                ));
            }
        }
        if let Some(r) = self.cpu_reserve {
            let most = crate::reserve::RESERVABLE * online as f64;
            if !r.is_finite() || r <= 0.0 || r > most {
                return Err(invalid(
                    "cpu_reserve",
                    r,
                    format!(
                        "must be > 0 and <= {most} ({}% of the {online} online CPUs)",
                        (crate::reserve::RESERVABLE * 100.0).round()
                    ),
                ));
            }
            if let Some(c) = self.cpus.filter(|c| *c < r) {
                return Err(invalid(
                    "cpu_reserve",
                    r,
                    format!("must be <= cpus ({c}): a box cannot be guaranteed more than its cap"),
                ));
            }
        }
        if let Some(p) = self.cpu_period_us {
            if !(1_000..=1_000_000).contains(&p) {
                return Err(invalid("cpu_period_us", p, "must be in 1000..=1000000"));
            }
        }
        if let Some(s) = self.cpu_shares {
            if !CPU_SHARES_RANGE.contains(&s) {
                return Err(invalid("cpu_shares", s, "must be in 2..=262144"));
            }
        }
        if let Some(list) = &self.cpuset_cpus {
            let cpus = parse_cpu_list(list)
                .map_err(|e| invalid("cpuset_cpus", format!("{list:?}"), cpu_list_reason(e)))?;
            if cpus.is_empty() {
                return Err(invalid("cpuset_cpus", format!("{list:?}"), "names no CPU"));
            }
        }
        if let Some(w) = self.io_weight {
            if !IO_WEIGHT_RANGE.contains(&w) {
                return Err(invalid("io_weight", w, "must be in 10..=1000"));
            }
        }
        for d in &self.io_devices {
            if let Some(w) = d.weight {
                if !IO_WEIGHT_RANGE.contains(&w) {
                    return Err(invalid(
                        "io_devices",
                        format!("{} weight {w}", d.device()),
                        "must be in 10..=1000",
                    ));
                }
            }
        }
        for p in &self.net_priorities {
            let name_ok = !p.interface.is_empty()
                && p.interface.len() < 16
                && !p
                    .interface
                    .contains(|c: char| c.is_whitespace() || c == '/');
            if !name_ok {
                return Err(invalid(
                    "net_priorities",
                    format!("{:?}", p.interface),
                    "is not an interface name",
                ));
            }
        }
        if let Some(s) = self.memory_swappiness {
            if s > 100 {
                return Err(invalid("memory_swappiness", s, "must be in 0..=100"));
            }
        }
        for (i, h) in self.hugepage_limits.iter().enumerate() {
            let name = hugepage_size_name(&h.page_size)?;
            if name != h.page_size {
                return Err(invalid(
                    "hugepage_limits",
                    format!("page size {:?}", h.page_size),
                    format!("the kernel names it {name}"),
                ));
            }
            if self.hugepage_limits[..i]
                .iter()
                .any(|o| o.page_size == h.page_size)
            {
                return Err(invalid(
                    "hugepage_limits",
                    format!("page size {:?}", h.page_size),
                    "is given twice",
                ));
            }
        }
        Ok(())
    }

    /// [`Self::validate`], plus: the cpuset CPUs must all be in the parent
    /// cgroup's cpuset (v1 `cpuset.cpus`, v2 `cpuset.cpus.effective`).
    pub fn validate_against(&self, h: &Hierarchies) -> Result<(), CgroupError> {
        self.validate()?;
        self.validate_cpuset_against(h)
    }

    pub(crate) fn validate_cpuset_against(&self, h: &Hierarchies) -> Result<(), CgroupError> {
        let Some(list) = &self.cpuset_cpus else {
            return Ok(());
        };
        let Some(hier) = h.find("cpuset") else {
            // Reported as an unavailable controller by create().
            return Ok(());
        };
        let (file, allowed) = parent_cpus(hier.version(), hier.invoking_dir())?;
        let wanted = parse_cpu_list(list)
            .map_err(|e| invalid("cpuset_cpus", format!("{list:?}"), cpu_list_reason(e)))?;
        let missing: Vec<String> = wanted
            .iter()
            .filter(|c| !allowed.contains(c))
            .map(u32::to_string)
            .collect();
        if !missing.is_empty() {
            return Err(invalid(
                "cpuset_cpus",
                format!("{list:?}"),
                format!(
                    "CPU(s) {} not in the parent's cpuset {:?} ({})",
                    missing.join(","),
                    fsutil::read(&file).unwrap_or_default().trim(),
                    file.display()
                ),
            ));
        }
        Ok(())
    }

    /// `cpus` as a CFS quota in microseconds per [`Self::cfs_period_us`].
    pub fn cfs_quota_us(&self) -> Option<u64> {
        self.cpus
            .map(|c| (c * self.cfs_period_us() as f64).round() as u64)
    }

    /// The CFS period in microseconds: `cpu_period_us` or [`CFS_PERIOD_US`].
    pub fn cfs_period_us(&self) -> u64 {
        self.cpu_period_us.unwrap_or(CFS_PERIOD_US)
    }

    /// `(option, v1 controller)` for every limit that is set.
    pub(crate) fn requested(&self) -> Vec<(&'static str, &'static str)> {
        let mut v = Vec::new();
        if self.memory.is_some() {
            v.push(("memory", "memory"));
        }
        if self.memory_swap.is_some() {
            v.push(("memory_swap", "memory"));
        }
        if self.pids.is_some() {
            v.push(("pids", "pids"));
        }
        if self.cpus.is_some() {
            v.push(("cpus", "cpu"));
        }
        if self.cpu_shares.is_some() {
            v.push(("cpu_shares", "cpu"));
        }
        if self.cpu_reserve.is_some() {
            v.push(("cpu_reserve", "cpu"));
        }
        if self.cpuset_cpus.is_some() {
            v.push(("cpuset_cpus", "cpuset"));
        }
        if self.io_weight.is_some() {
            v.push(("io_weight", "blkio"));
        }
        if self.memory_swappiness.is_some() {
            v.push(("memory_swappiness", "memory"));
        }
        if self.oom_kill_disable {
            v.push(("oom_kill_disable", "memory"));
        }
        if !self.io_devices.is_empty() {
            v.push(("io_devices", "blkio"));
        }
        if self.net_class_id.is_some() {
            v.push(("net_class_id", "net_cls"));
        }
        if !self.net_priorities.is_empty() {
            v.push(("net_priorities", "net_prio"));
        }
        if !self.hugepage_limits.is_empty() {
            v.push(("hugepage_limits", "hugetlb"));
        }
        v
    }
}

fn cpu_list_reason(e: CgroupError) -> String {
    match e {
        CgroupError::CpuList { reason, .. } => reason,
        other => other.to_string(),
    }
}

/// The CPUs of the parent cgroup `dir` and the file they came from.
fn parent_cpus(
    version: Version,
    dir: &Path,
) -> Result<(std::path::PathBuf, Vec<u32>), CgroupError> {
    let candidates: &[&str] = match version {
        Version::V1 => &["cpuset.cpus", "cpuset.effective_cpus"],
        Version::V2 => &["cpuset.cpus.effective", "cpuset.cpus"],
    };
    let mut last = None;
    for name in candidates {
        let file = dir.join(name);
        if let Some(text) = fsutil::read_opt(&file)? {
            let cpus = parse_cpu_list(&text)?;
            if !cpus.is_empty() {
                return Ok((file, cpus));
            }
        }
        last = Some(file);
    }
    // Nothing readable: fall back to the online CPUs.
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default();
    Ok((
        last.unwrap_or_else(|| dir.to_path_buf()),
        parse_cpu_list(&online)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-2,4").unwrap(), vec![0, 1, 2, 4]);
        assert_eq!(parse_cpu_list(" 3,1,1-2\n").unwrap(), vec![1, 2, 3]);
        assert_eq!(parse_cpu_list("7").unwrap(), vec![7]);
        assert_eq!(parse_cpu_list("\n").unwrap(), Vec::<u32>::new());
        for bad in [
            "a",
            "1-",
            "-1",
            "3-1",
            "1,,2",
            "1 2",
            "0-99999999",
            "+1",
            "1-2-3",
        ] {
            let e = parse_cpu_list(bad).unwrap_err();
            assert!(matches!(e, CgroupError::CpuList { .. }), "{bad}: {e}");
        }
    }

    #[test]
    fn weight_conversion() {
        assert_eq!(shares_to_weight(2), 1);
        assert_eq!(shares_to_weight(1024), 39);
        assert_eq!(shares_to_weight(512), 20);
        assert_eq!(shares_to_weight(262_144), 10_000);
    }

    #[test]
    fn quota() {
        let l = Limits {
            cpus: Some(0.5),
            ..Default::default()
        };
        assert_eq!(l.cfs_quota_us(), Some(50_000));
    }

    fn msg(l: Limits) -> String {
        l.validate_with_online(2).unwrap_err().to_string()
    }

    #[test]
    fn validation_errors() {
        assert!(Limits::default().validate_with_online(2).is_ok());
        assert_eq!(
            msg(Limits {
                memory: Some(1 << 20),
                memory_reserve: Some(2 << 20),
                ..Default::default()
            }),
            "cgroup: invalid memory_reserve=2097152: must be <= memory (1048576): a box cannot be guaranteed more than it may use"
        );
        assert!(Limits {
            memory: Some(2 << 20),
            memory_reserve: Some(2 << 20),
            ..Default::default()
        }
        .validate_with_online(2)
        .is_ok());
        assert_eq!(
            msg(Limits {
                cpus: Some(3.0),
                ..Default::default()
            }),
            "cgroup: invalid cpus=3: must be > 0 and <= 2 (online CPUs)"
        );
        assert!(msg(Limits {
            cpus: Some(0.0),
            ..Default::default()
        })
        .starts_with("cgroup: invalid cpus=0:"));
        assert!(msg(Limits {
            cpus: Some(f64::NAN),
            ..Default::default()
        })
        .contains("cpus=NaN"));
        assert!(msg(Limits {
            cpus: Some(0.001),
            ..Default::default()
        })
        .contains("minimum CFS quota"));
        assert_eq!(
            msg(Limits {
                cpu_shares: Some(1),
                ..Default::default()
            }),
            "cgroup: invalid cpu_shares=1: must be in 2..=262144"
        );
        assert!(msg(Limits {
            cpu_shares: Some(262_145),
            ..Default::default()
        })
        .contains("cpu_shares=262145"));
        assert_eq!(
            msg(Limits {
                pids: Some(0),
                ..Default::default()
            }),
            "cgroup: invalid pids=0: must be >= 1"
        );
        assert_eq!(
            msg(Limits {
                io_weight: Some(5),
                ..Default::default()
            }),
            "cgroup: invalid io_weight=5: must be in 10..=1000"
        );
        assert!(msg(Limits {
            cpuset_cpus: Some("0-".into()),
            ..Default::default()
        })
        .starts_with("cgroup: invalid cpuset_cpus=\"0-\":"));
        assert!(msg(Limits {
            memory: Some(100),
            memory_swap: Some(50),
            ..Default::default()
        })
        .contains("memory_swap=50: must be >= memory (100)"));
        assert!(msg(Limits {
            memory_swap: Some(50),
            ..Default::default()
        })
        .contains("needs memory"));
        assert!(msg(Limits {
            memory: Some(100),
            memory_swap: Some(-2),
            ..Default::default()
        })
        .contains("memory_swap=-2"));
        assert!(Limits {
            memory: Some(100),
            memory_swap: Some(-1),
            cpus: Some(2.0),
            cpuset_cpus: Some("0-1".into()),
            ..Default::default()
        }
        .validate_with_online(2)
        .is_ok());
    }

    #[test]
    fn serde_roundtrip_and_defaults() {
        let l = Limits {
            memory: Some(1),
            cpus: Some(0.5),
            ..Default::default()
        };
        let s = serde_json::to_string(&l).unwrap();
        assert_eq!(serde_json::from_str::<Limits>(&s).unwrap(), l);
        assert_eq!(
            serde_json::from_str::<Limits>(r#"{"pids": 5}"#).unwrap(),
            Limits {
                pids: Some(5),
                ..Default::default()
            }
        );
    }

    #[test]
    fn cpuset_against_parent() {
        let tmp = tempfile::tempdir().unwrap();
        let h = crate::testfs::pure_v1(tmp.path());
        let ok = Limits {
            cpuset_cpus: Some("1-3".into()),
            ..Default::default()
        };
        ok.validate_cpuset_against(&h).unwrap();
        let bad = Limits {
            cpuset_cpus: Some("2-5".into()),
            ..Default::default()
        };
        let e = bad.validate_cpuset_against(&h).unwrap_err().to_string();
        assert!(
            e.contains("cpuset_cpus=\"2-5\": CPU(s) 4,5 not in the parent's cpuset \"0-3\""),
            "{e}"
        );
    }
}
