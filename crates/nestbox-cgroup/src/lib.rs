//! Resource control of nestbox boxes through cgroups.
//!
//! cgroup v1 and v2 sit behind one interface and are detected at run time,
//! per controller: each controller is used wherever it is mounted — in a v1
//! hierarchy (possibly co-mounted, like `cpu,cpuacct`) or in the v2
//! hierarchy — so pure v1, pure v2 and hybrid systems all work.
//!
//! ```no_run
//! use nestbox_cgroup::{BoxCgroup, Hierarchies, Limits};
//! # fn main() -> Result<(), nestbox_cgroup::CgroupError> {
//! let h = Hierarchies::detect()?;
//! let limits = Limits { memory: Some(64 << 20), pids: Some(10), ..Default::default() };
//! limits.validate()?;
//! let cg = BoxCgroup::create(&h, "0a1b2c", &limits)?;
//! cg.add_process(1234)?;
//! let state = serde_json::to_string(&cg).unwrap(); // saved; re-opened later
//! let cg: BoxCgroup = serde_json::from_str(&state).unwrap();
//! cg.kill_all()?;
//! cg.remove()?;
//! # Ok(()) }
//! ```
//!
//! Modules: [`detect`] finds the hierarchies, [`limits`] describes and
//! validates limits, [`reserve`] keeps CPU reservations, `v1`/`v2` write
//! control files, [`boxcg`] is the box's
//! cgroup, [`stats`] its usage, [`gc`] finds leftovers, [`error`] the errors.

pub mod boxcg;
pub mod detect;
pub mod devfilter;
pub mod error;
mod fsutil;
pub mod gc;
pub mod limits;
pub mod reserve;
pub mod stats;
#[cfg(test)]
mod testfs;
#[cfg(test)]
mod tests;
mod v1;
mod v2;

pub use boxcg::{
    dir_name, validate_id, BoxCgroup, BoxMount, CgroupDir, Delegation, DeviceRule, PendingCgroup,
    FREEZE_TIMEOUT, KILL_TIMEOUT, V2_LEAF,
};
pub use detect::{Hierarchies, Hierarchy, Version};
pub use error::{CgroupError, CgroupWarning, Op};
pub use gc::find_stale;
pub use limits::{
    hugepage_size_name, kernel_hugepage_sizes, online_cpus, parse_cpu_list, shares_to_weight,
    HugepageLimit, IoDeviceLimit, Limits, NetPriority,
};
pub use stats::Stats;
pub use v1::DEFAULT_DEVICE_RULES;
