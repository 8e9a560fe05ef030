//! `linux.resources` onto nestbox-cgroup's [`Limits`]: memory, swap, pids,
//! CPU shares, quota and cpuset, block I/O weight and per-device limits,
//! network class and priorities, hugepage limits. Other controls are refused
//! with the field named, never silently dropped (except the kernel-memory
//! limits, which the kernel no longer has), and `linux.resources.devices`
//! onto the device cgroup's rules.

use nestbox_cgroup::{DeviceRule, Limits};
use oci_spec::runtime::LinuxResources;

use crate::{OciError, Result};

fn refuse(field: &str) -> OciError {
    OciError::Unsupported(format!("linux.resources.{field} is not supported"))
}

/// The limits of `resources` (none when absent).
pub fn limits(resources: Option<&LinuxResources>) -> Result<Limits> {
    let mut l = Limits::default();
    let Some(r) = resources else {
        return Ok(l);
    };
    if let Some(m) = r.memory() {
        l.memory = m.limit().filter(|v| *v > 0).map(|v| v as u64);
        l.memory_swap = m.swap().filter(|v| *v != 0);
        l.memory_reserve = m.reservation().filter(|v| *v > 0).map(|v| v as u64);
        // A swappiness above 100 is refused by Limits::validate, naming it.
        l.memory_swappiness = m.swappiness();
        l.oom_kill_disable = m.disable_oom_killer() == Some(true);
        if m.use_hierarchy().is_some() || m.check_before_update().is_some() {
            return Err(refuse("memory.useHierarchy/checkBeforeUpdate"));
        }
        // memory.kernel and memory.kernelTCP are not refused but have no
        // effect: Linux removed the kernel-memory limits of cgroup v1 (6.x
        // has no memory.kmem.limit_in_bytes) and v2 never had them; runc
        // ignores them too (docs/oci.md).
    }
    if let Some(p) = r.pids() {
        if p.limit() > 0 {
            l.pids = Some(p.limit() as u64);
        }
    }
    if let Some(c) = r.cpu() {
        l.cpu_shares = c.shares().filter(|v| *v > 0);
        if let (Some(quota), period) = (c.quota(), c.period()) {
            if quota > 0 {
                let period = period.filter(|p| *p > 0);
                l.cpu_period_us = period;
                let period = period.unwrap_or(nestbox_cgroup::limits::CFS_PERIOD_US);
                l.cpus = Some(quota as f64 / period as f64);
            }
        }
        l.cpuset_cpus = c.cpus().clone().filter(|s| !s.is_empty());
        if c.realtime_runtime().is_some() || c.realtime_period().is_some() {
            return Err(refuse("cpu.realtimeRuntime"));
        }
    }
    if let Some(b) = r.block_io() {
        l.io_weight = b.weight();
        l.io_devices = io_devices(b)?;
    }
    if let Some(list) = r.hugepage_limits() {
        l.hugepage_limits = hugepage_limits(
            list,
            &nestbox_cgroup::kernel_hugepage_sizes(std::path::Path::new(
                nestbox_cgroup::limits::HUGEPAGES_SYSFS,
            )),
        )?;
    }
    if let Some(n) = r.network() {
        l.net_class_id = n.class_id();
        l.net_priorities = n
            .priorities()
            .iter()
            .flatten()
            .map(|p| nestbox_cgroup::NetPriority {
                interface: p.name().clone(),
                priority: p.priority(),
            })
            .collect();
    }
    if r.rdma().as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(refuse("rdma"));
    }
    l.validate()?;
    Ok(l)
}

/// `hugepageLimits` with the page sizes by the kernel's names, each one the
/// kernel has (`have`, from [`nestbox_cgroup::kernel_hugepage_sizes`]):
/// checked before anything is made, so a size the kernel lacks is one line
/// and leaves nothing (not even hugetlb enabled in a v2 parent).
fn hugepage_limits(
    list: &[oci_spec::runtime::LinuxHugepageLimit],
    have: &[String],
) -> Result<Vec<nestbox_cgroup::HugepageLimit>> {
    list.iter()
        .map(|h| {
            let given = h.page_size();
            let bad = |why: String| {
                OciError::Unsupported(format!(
                    "linux.resources.hugepageLimits: page size {given:?}: {why}"
                ))
            };
            let name = nestbox_cgroup::hugepage_size_name(given)
                .map_err(|_| bad("is not <number>KB, MB or GB (as 2MB, 1GB)".into()))?;
            if !have.contains(&name) {
                return Err(bad(format!(
                    "the kernel has no huge pages of that size (it has {})",
                    if have.is_empty() {
                        "none".to_string()
                    } else {
                        have.join(", ")
                    }
                )));
            }
            let limit = u64::try_from(h.limit())
                .map_err(|_| bad(format!("limit {} is negative", h.limit())))?;
            Ok(nestbox_cgroup::HugepageLimit {
                page_size: name,
                limit,
            })
        })
        .collect()
}

/// The per-device limits of `blockIO`: one entry per device, its weight and
/// throttles gathered. Leaf weights are refused: Linux has had none since
/// 5.0 (they were CFQ's), on cgroup v1 or v2.
fn io_devices(b: &oci_spec::runtime::LinuxBlockIo) -> Result<Vec<nestbox_cgroup::IoDeviceLimit>> {
    if b.leaf_weight().is_some()
        || b.weight_device()
            .iter()
            .flatten()
            .any(|d| d.leaf_weight().is_some())
    {
        return Err(OciError::Unsupported(
            "linux.resources.blockIO.leafWeight is not supported: Linux has no leaf weights since 5.0 (CFQ was removed)".into(),
        ));
    }
    let mut out: Vec<nestbox_cgroup::IoDeviceLimit> = Vec::new();
    let mut entry = |field: &str, major: i64, minor: i64| -> Result<usize> {
        let (Ok(major), Ok(minor)) = (u32::try_from(major), u32::try_from(minor)) else {
            return Err(OciError::Unsupported(format!(
                "linux.resources.blockIO.{field}: device {major}:{minor} is not a device number"
            )));
        };
        Ok(
            match out
                .iter()
                .position(|d| (d.major, d.minor) == (major, minor))
            {
                Some(i) => i,
                None => {
                    out.push(nestbox_cgroup::IoDeviceLimit {
                        major,
                        minor,
                        ..Default::default()
                    });
                    out.len() - 1
                }
            },
        )
    };
    let mut weights = Vec::new();
    for d in b.weight_device().iter().flatten() {
        if let Some(w) = d.weight() {
            weights.push((entry("weightDevice", d.major(), d.minor())?, w));
        }
    }
    let mut throttles = Vec::new();
    for (field, list, which) in [
        ("throttleReadBpsDevice", b.throttle_read_bps_device(), 0),
        ("throttleWriteBpsDevice", b.throttle_write_bps_device(), 1),
        ("throttleReadIOPSDevice", b.throttle_read_iops_device(), 2),
        ("throttleWriteIOPSDevice", b.throttle_write_iops_device(), 3),
    ] {
        for d in list.iter().flatten() {
            throttles.push((entry(field, d.major(), d.minor())?, which, d.rate()));
        }
    }
    for (i, w) in weights {
        out[i].weight = Some(w);
    }
    for (i, which, rate) in throttles {
        let d = &mut out[i];
        match which {
            0 => d.read_bps = Some(rate),
            1 => d.write_bps = Some(rate),
            2 => d.read_iops = Some(rate),
            _ => d.write_iops = Some(rate),
        }
    }
    Ok(out)
}

/// The device-cgroup rules of `resources.devices`, checked (`None` when the
/// config gives none: the cgroup then keeps nestbox's default rules).
pub fn device_rules(resources: Option<&LinuxResources>) -> Result<Option<Vec<DeviceRule>>> {
    use oci_spec::runtime::LinuxDeviceType as T;
    let Some(list) = resources.and_then(|r| r.devices().as_ref()) else {
        return Ok(None);
    };
    let mut rules = Vec::with_capacity(list.len());
    for (i, d) in list.iter().enumerate() {
        let kind = match d.typ().unwrap_or_default() {
            T::A => 'a',
            T::B => 'b',
            T::C | T::U => 'c',
            T::P => {
                return Err(OciError::Unsupported(format!(
                    "linux.resources.devices[{i}]: type \"p\" (FIFO) has no device-cgroup rule"
                )))
            }
        };
        let access = d.access().clone().unwrap_or_else(|| "rwm".into());
        if access.is_empty() || !access.chars().all(|c| "rwm".contains(c)) {
            return Err(OciError::Unsupported(format!(
                "linux.resources.devices[{i}]: access {access:?} must be made of r, w and m"
            )));
        }
        for (what, n) in [("major", d.major()), ("minor", d.minor())] {
            if n.is_some_and(|v| v < 0) {
                return Err(OciError::Unsupported(format!(
                    "linux.resources.devices[{i}]: negative {what}"
                )));
            }
        }
        rules.push(DeviceRule {
            allow: d.allow(),
            kind,
            major: d.major(),
            minor: d.minor(),
            access,
        });
    }
    Ok(Some(rules))
}

/// The rules a container's device cgroup gets from `config` rules: those,
/// in order, then (as runc does) access to the standard devices every
/// container has (null, zero, full, random, urandom, tty, ptmx, pts,
/// `mknod`) and to each device of `linux.devices`.
pub fn full_device_rules(
    config: &[DeviceRule],
    devices: &[crate::config::Device],
) -> Vec<DeviceRule> {
    let mut rules = config.to_vec();
    for text in nestbox_cgroup::DEFAULT_DEVICE_RULES {
        // "c 1:3 rwm": type, major:minor, access.
        let mut parts = text.split_whitespace();
        let (Some(kind), Some(nums), Some(access)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (major, minor) = nums.split_once(':').unwrap_or(("*", "*"));
        rules.push(DeviceRule {
            allow: true,
            kind: kind.chars().next().unwrap_or('a'),
            major: major.parse().ok(),
            minor: minor.parse().ok(),
            access: access.to_string(),
        });
    }
    for d in devices {
        let kind = match d.kind {
            nestbox_sys::node::NodeKind::Block => 'b',
            nestbox_sys::node::NodeKind::Char => 'c',
            _ => continue,
        };
        rules.push(DeviceRule {
            allow: true,
            kind,
            major: Some(d.major as i64),
            minor: Some(d.minor as i64),
            access: "rwm".into(),
        });
    }
    rules
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resources(json: serde_json::Value) -> LinuxResources {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn hugepage_limits_are_named_as_the_kernel_does_and_checked_against_its_sizes() {
        let have = ["1GB".to_string(), "2MB".to_string()];
        let r = resources(serde_json::json!({"hugepageLimits": [
            {"pageSize": "2048KB", "limit": 4194304},
            {"pageSize": "1GB", "limit": 2147483648u64},
        ]}));
        let got = hugepage_limits(r.hugepage_limits().as_ref().unwrap(), &have).unwrap();
        assert_eq!(
            got.iter()
                .map(|h| (h.page_size.as_str(), h.limit))
                .collect::<Vec<_>>(),
            [("2MB", 4 << 20), ("1GB", 2 << 30)]
        );
        for (bad, why) in [
            (
                "3MB",
                "the kernel has no huge pages of that size (it has 1GB, 2MB)",
            ),
            ("2M", "is not <number>KB, MB or GB"),
        ] {
            let r = resources(serde_json::json!({"hugepageLimits": [
                {"pageSize": bad, "limit": 1}
            ]}));
            let e = hugepage_limits(r.hugepage_limits().as_ref().unwrap(), &have)
                .unwrap_err()
                .to_string();
            assert!(e.contains("linux.resources.hugepageLimits"), "{e}");
            assert!(e.contains(why), "{e}");
        }
        let r = resources(serde_json::json!({"hugepageLimits": [
            {"pageSize": "2MB", "limit": -1}
        ]}));
        let e = hugepage_limits(r.hugepage_limits().as_ref().unwrap(), &have).unwrap_err();
        assert!(e.to_string().contains("negative"), "{e}");
        let e = hugepage_limits(r.hugepage_limits().as_ref().unwrap(), &[]).unwrap_err();
        assert!(e.to_string().contains("(it has none)"), "{e}");
    }

    #[test]
    fn device_rules_are_read_and_checked() {
        assert!(device_rules(None).unwrap().is_none());
        let r = resources(serde_json::json!({"devices": [
            {"allow": false, "access": "rwm"},
            {"allow": true, "type": "c", "major": 1, "minor": 3, "access": "rw"},
            {"allow": true, "type": "b", "major": 8, "access": "m"},
        ]}));
        let rules = device_rules(Some(&r)).unwrap().unwrap();
        let texts: Vec<String> = rules.iter().map(|r| r.v1_text()).collect();
        assert_eq!(texts, ["a *:* rwm", "c 1:3 rw", "b 8:* m"]);
        assert_eq!(
            rules.iter().map(|r| r.allow).collect::<Vec<_>>(),
            [false, true, true]
        );
        for bad in [
            serde_json::json!({"devices": [{"allow": true, "type": "c", "access": "rwx"}]}),
            serde_json::json!({"devices": [{"allow": true, "type": "c", "access": ""}]}),
            serde_json::json!({"devices": [{"allow": true, "type": "p"}]}),
            serde_json::json!({"devices": [{"allow": true, "type": "c", "major": -1}]}),
        ] {
            let e = device_rules(Some(&resources(bad.clone()))).unwrap_err();
            assert!(
                e.to_string().contains("linux.resources.devices[0]"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn the_standard_devices_follow_the_config_rules() {
        let config = [DeviceRule {
            allow: false,
            kind: 'a',
            major: None,
            minor: None,
            access: "rwm".into(),
        }];
        let dev = crate::config::Device {
            path: "/dev/fuse".into(),
            kind: nestbox_sys::node::NodeKind::Char,
            major: 10,
            minor: 229,
            mode: 0o666,
            uid: 0,
            gid: 0,
        };
        let rules = full_device_rules(&config, &[dev]);
        let texts: Vec<String> = rules.iter().map(|r| r.v1_text()).collect();
        assert_eq!(texts[0], "a *:* rwm");
        assert!(!rules[0].allow);
        assert!(texts.contains(&"c 1:3 rwm".to_string()));
        assert!(texts.contains(&"c 136:* rwm".to_string()));
        assert_eq!(texts.last().unwrap(), "c 10:229 rwm");
        assert!(rules[1..].iter().all(|r| r.allow));
    }
}
