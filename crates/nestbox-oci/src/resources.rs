//! `linux.resources` onto nestbox-cgroup's [`Limits`]: memory, swap, pids,
//! CPU shares, quota and cpuset, block I/O weight. Other controls are refused
//! with the field named, never silently dropped (except the kernel-memory
//! limits, which the kernel no longer has).

use nestbox_cgroup::Limits;
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
        if m.swappiness().is_some() {
            return Err(refuse("memory.swappiness"));
        }
        if m.disable_oom_killer() == Some(true) {
            return Err(refuse("memory.disableOOMKiller"));
        }
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
        if b.weight_device().as_ref().is_some_and(|v| !v.is_empty())
            || b.throttle_read_bps_device()
                .as_ref()
                .is_some_and(|v| !v.is_empty())
            || b.throttle_write_bps_device()
                .as_ref()
                .is_some_and(|v| !v.is_empty())
        {
            return Err(refuse("blockIO per-device limits"));
        }
    }
    if r.hugepage_limits().as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(refuse("hugepageLimits"));
    }
    if r.network().is_some() {
        return Err(refuse("network"));
    }
    if r.rdma().as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(refuse("rdma"));
    }
    l.validate()?;
    Ok(l)
}
