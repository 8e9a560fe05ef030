//! Claims prepared ahead of their request, for a long-lived server.
//!
//! Claiming a pooled clone reads records and `/proc` to find the template and a
//! live pooled clone, then renames the clone and wakes it. `nestbox serve`
//! does the finding while it is idle, for each template it has been asked for:
//! a [`PreparedClaim`] holds the template's and the clone's records, the
//! identity of the template's state file, and pidfds of the processes whose
//! death would make the claim wrong. When the request comes, checking that
//! nothing changed takes one `statx` and a `poll` of those pidfds; then the
//! clone is renamed and woken as any claim does. If anything changed (the
//! template was removed or thawed, a process died, another claimer took the
//! clone), the request takes the ordinary path instead.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use crate::clone::{CloneRequest, Cloned, FollowUp};
use crate::liveness::ProcRef;
use crate::registry::{BoxRecord, Registry};
use crate::Result;

/// The identity of a file's current version: records are replaced, never
/// written in place, so a new version is a new inode with a new change time.
type Stamp = (u64, u64, i64, i64);

fn stamp(path: &std::path::Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

/// A pooled clone looked up ahead of the request that will claim it.
#[derive(Debug)]
pub struct PreparedClaim {
    template: String,
    template_state: PathBuf,
    template_stamp: Stamp,
    /// Pidfds of the template's monitor and process and of the pooled clone's
    /// monitor and process: readable once one has exited.
    watched: Vec<OwnedFd>,
    candidate: BoxRecord,
}

/// Look up the template `template` and the pooled clone a claim would take.
/// `None` when it has no live pooled clone (or changed while being read).
pub fn prepare(reg: &Registry, template: &str) -> Result<Option<PreparedClaim>> {
    let state = |t: &BoxRecord| t.run_dir().join("state.json");
    let t = crate::template::load_frozen(reg, template)?;
    let template_state = state(&t);
    let Some(before) = stamp(&template_state) else {
        return Ok(None);
    };
    let Some(candidate) = crate::clone::first_live_pooled(reg, &t)? else {
        return Ok(None);
    };
    let processes: Vec<ProcRef> = [
        t.state.monitor,
        t.state.template.as_ref().map(|i| i.process),
        candidate.state.monitor,
        candidate.state.clone.as_ref().and_then(|c| c.process),
    ]
    .into_iter()
    .flatten()
    .collect();
    let mut watched = Vec::new();
    for p in processes {
        let Ok(fd) = crate::process::pidfd_open(p.pid) else {
            return Ok(None);
        };
        // Checked after opening: the pidfd is of that process, not of one
        // that took over its pid.
        if !p.alive() {
            return Ok(None);
        }
        watched.push(fd);
    }
    // The template's record read above is the one whose stamp is kept.
    let t_again = crate::template::load_frozen(reg, template)?;
    if stamp(&template_state) != Some(before) || t_again.state.id != t.state.id {
        return Ok(None);
    }
    Ok(Some(PreparedClaim {
        template: template.to_string(),
        template_state,
        template_stamp: before,
        watched,
        candidate,
    }))
}

impl PreparedClaim {
    /// Whether the template's record and every watched process are as they
    /// were when it was prepared.
    fn still_valid(&self) -> bool {
        if stamp(&self.template_state) != Some(self.template_stamp) {
            return false;
        }
        let mut fds: Vec<PollFd<'_>> = self
            .watched
            .iter()
            .map(|fd| PollFd::new(fd.as_fd(), PollFlags::POLLIN))
            .collect();
        matches!(poll(&mut fds, PollTimeout::ZERO), Ok(0))
    }

    /// Claim the prepared clone as `name` (a new name, checked here), with the
    /// request's signal. `None` when something changed since it was prepared:
    /// the caller then takes the ordinary path.
    pub fn claim(
        self,
        reg: &Registry,
        name: &str,
        req: &CloneRequest,
        follow_up: &mut FollowUp,
    ) -> Result<Option<Cloned>> {
        if !self.still_valid() {
            return Ok(None);
        }
        crate::clone::check_new_name(reg, name)?;
        let made = crate::clone::take_pooled(reg, &self.candidate, name, req, follow_up)?;
        if made.is_some() {
            follow_up.refill.push(self.template);
        }
        // A clone of a nest template saved with its boxes runs them again.
        if let (Some(c), true) = (&made, self.candidate.spec.nest) {
            crate::clone::resume_boxes_inside(reg, std::slice::from_ref(c))?;
        }
        Ok(made)
    }
}
