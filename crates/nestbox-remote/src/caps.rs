//! The capability state of a process and how to give it back to a forked copy.
//!
//! Joining a user namespace (`setns(CLONE_NEWUSER)`) gives the caller every
//! capability in it, a full bounding set, no inheritable or ambient capabilities and
//! default securebits. The clone must end with exactly the template's state, so
//! after the namespace joins the injected calls are: `PR_CAPBSET_DROP` for each
//! capability outside the template's bounding set, `PR_SET_SECUREBITS`, `capset`
//! (effective, permitted, inheritable), then `PR_CAP_AMBIENT_RAISE` for the ambient
//! set. `no_new_privs` and the seccomp filter are inherited by fork and untouched
//! by `setns`.

use serde::Serialize;

use crate::batch::Batch;
use crate::error::Result;
use crate::memory::Scratch;
use crate::procfs::{read_to_string, Status};
use crate::tracee::Tracee;

/// `_LINUX_CAPABILITY_VERSION_3`.
const CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// A process's capability sets (bit `n` = capability `n`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct CapState {
    /// `CapInh`.
    pub inheritable: u64,
    /// `CapPrm`.
    pub permitted: u64,
    /// `CapEff`.
    pub effective: u64,
    /// `CapBnd`.
    pub bounding: u64,
    /// `CapAmb`.
    pub ambient: u64,
    /// `NoNewPrivs`.
    pub no_new_privs: bool,
    /// `Seccomp` mode (2: filter).
    pub seccomp: u8,
}

impl CapState {
    /// Read from `/proc/PID/status`.
    pub fn read(pid: i32) -> Result<CapState> {
        CapState::from_status(&Status::read(pid)?)
    }

    /// From a `/proc/PID/status` already read.
    pub fn from_status(status: &Status) -> Result<CapState> {
        Ok(CapState {
            inheritable: status.hex("CapInh")?,
            permitted: status.hex("CapPrm")?,
            effective: status.hex("CapEff")?,
            bounding: status.hex("CapBnd")?,
            ambient: status.hex("CapAmb")?,
            no_new_privs: status.decimal::<u8>("NoNewPrivs")? != 0,
            seccomp: status.decimal("Seccomp")?,
        })
    }
}

/// Highest capability number this kernel knows.
pub(crate) fn last_cap() -> u32 {
    read_to_string(std::path::Path::new("/proc/sys/kernel/cap_last_cap"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
}

/// Restoring the capability state of `tracee`, which has just joined a user
/// namespace and holds every capability in it, part one: drop from its
/// bounding set (now `current`) what `bounding` lacks, and set `securebits`.
/// The effective set is untouched: threads cloned afterwards inherit both, and
/// still every capability. Part two is [`restore_sets`]. All in one resume
/// (some thirty calls; see batch.rs), through `scratch`.
pub(crate) fn restore_bounding(
    tracee: &mut Tracee,
    scratch: &mut Scratch,
    bounding: u64,
    current: u64,
    securebits: u64,
) -> Result<()> {
    let mut batch = Batch::new();
    for cap in 0..=last_cap() {
        if bounding & (1 << cap) == 0 && current & (1 << cap) != 0 {
            batch.push(
                "prctl(PR_CAPBSET_DROP)",
                format!("capability {cap}"),
                libc::SYS_prctl,
                &[libc::PR_CAPBSET_DROP as u64, u64::from(cap)],
            );
        }
    }
    if securebits != 0 {
        batch.push(
            "prctl(PR_SET_SECUREBITS)",
            format!("securebits {securebits:#x}"),
            libc::SYS_prctl,
            &[libc::PR_SET_SECUREBITS as u64, securebits],
        );
    }
    scratch.reset();
    batch.run(tracee, scratch)?;
    Ok(())
}

/// Restoring the capability state, part two: the effective, permitted, inheritable and
/// ambient sets of `tracee`.
pub(crate) fn restore_sets(
    tracee: &mut Tracee,
    scratch: &mut Scratch,
    want: &CapState,
) -> Result<()> {
    scratch.reset();
    let header = scratch.put(tracee, &capset_data(want))?;
    tracee.syscall(
        "capset",
        || {
            format!(
                "effective {:#x} permitted {:#x}",
                want.effective, want.permitted
            )
        },
        libc::SYS_capset,
        &[header, header + 8],
    )?;
    raise_ambient(tracee, want)
}

/// The `capset` argument for `want`: the v3 header (pid 0: the calling
/// thread) at offset 0, then the two data structures at offset 8.
pub(crate) fn capset_data(want: &CapState) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(32);
    bytes.extend_from_slice(&CAPABILITY_VERSION_3.to_ne_bytes());
    bytes.extend_from_slice(&0i32.to_ne_bytes());
    for half in [0, 32] {
        bytes.extend_from_slice(&((want.effective >> half) as u32).to_ne_bytes());
        bytes.extend_from_slice(&((want.permitted >> half) as u32).to_ne_bytes());
        bytes.extend_from_slice(&((want.inheritable >> half) as u32).to_ne_bytes());
    }
    bytes
}

/// Raise the ambient capabilities of `want` in `tracee` (after `capset`).
pub(crate) fn raise_ambient(tracee: &mut Tracee, want: &CapState) -> Result<()> {
    for cap in 0..=last_cap() {
        if want.ambient & (1 << cap) != 0 {
            tracee.syscall(
                "prctl(PR_CAP_AMBIENT_RAISE)",
                || format!("capability {cap}"),
                libc::SYS_prctl,
                &[
                    libc::PR_CAP_AMBIENT as u64,
                    libc::PR_CAP_AMBIENT_RAISE as u64,
                    u64::from(cap),
                ],
            )?;
        }
    }
    Ok(())
}
