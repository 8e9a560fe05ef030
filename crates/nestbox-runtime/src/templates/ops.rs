//! The box operations that must know about templates and clones: `stop` leaves a
//! template's init for its clones, `rm` removes a template with its pool and
//! learns from a leaving clone, `inspect` shows how much memory a clone shares.
//! They are the plain-box operations of [`crate::lifecycle::ops`] with
//! [`TemplateRelations`] plugged in.

use std::time::Duration;

use crate::lifecycle::ops::{self as plain, Relations};
use crate::registry::{BoxRecord, Registry};
use crate::state::Status;
use crate::Result;

/// What the templates layer knows about a box: whether it is a template with
/// clones, or a clone whose template learns from it.
#[derive(Debug, Clone, Copy, Default)]
pub struct TemplateRelations;

impl Relations for TemplateRelations {
    fn keeps_init(&self, reg: &Registry, record: &BoxRecord) -> Result<bool> {
        Ok(!crate::template::clones_of(reg, record.name())?.is_empty())
    }
    fn remove_frozen(&self, reg: &Registry, record: &BoxRecord) -> Option<Result<()>> {
        record
            .state
            .template
            .is_some()
            .then(|| crate::template::remove_box(reg, record))
    }
    fn before_removal(&self, reg: &Registry, record: &BoxRecord) {
        crate::clone::learn_from_leaving_clone(reg, record);
    }
    fn inspect_extra(&self, reg: &Registry, record: &BoxRecord) -> Option<serde_json::Value> {
        crate::clone::sharing(reg, record)
    }
    fn after_removal(&self, reg: &Registry, record: &BoxRecord) {
        if let Some(src) = &record.spec.clone_of {
            settle_removed_template(reg, &src.template_box);
        }
    }
}

/// Stop a box (see [`plain::stop`]); a template with live clones keeps its init.
pub fn stop(reg: &Registry, name: &str, timeout: Duration) -> Result<()> {
    plain::stop_with(reg, &TemplateRelations, name, timeout)
}

/// Remove a box (see [`plain::remove`]); a template goes with its pool.
pub fn remove(reg: &Registry, name: &str, force: bool) -> Result<()> {
    plain::remove_with(reg, &TemplateRelations, name, force)
}

/// Remove boxes (see [`plain::remove_many_with`]): the running ones are
/// killed together first. One result per name.
///
/// A template named here that still had clones when its turn came was only
/// marked removed: it goes by itself once its last clone has. Each is waited
/// for here once its clones are gone ([`settle_removed_template`]), in as
/// many rounds as there are such templates, so that a chain (a template whose clone is
/// itself a template, all named) is gone when this returns, whichever of its
/// links left first. Waiting only from a removed clone missed a template whose
/// clone-template had already gone by itself.
pub fn remove_many(reg: &Registry, names: &[String], force: bool) -> Vec<Result<()>> {
    let results = plain::remove_many_with(reg, &TemplateRelations, names, force);
    // Only what is still there: templates kept for their clones.
    let kept: Vec<&String> = names
        .iter()
        .zip(&results)
        .filter(|(name, r)| r.is_ok() && reg.load(name).is_ok())
        .map(|(name, _)| name)
        .collect();
    for _ in 0..kept.len() {
        for name in &kept {
            settle_removed_template(reg, name);
        }
    }
    results
}

/// Everything known about a box, as JSON (see [`plain::inspect`]).
pub fn inspect(reg: &Registry, name: &str) -> Result<serde_json::Value> {
    let mut v = plain::inspect_with(reg, &TemplateRelations, name)?;
    // The stack attached to the running box (`nestbox monitor attach`), if
    // one is; its `trace` monitors write to the box's trace log.
    if let Some(a) = reg
        .load(name)
        .ok()
        .and_then(|r| crate::attach::attached(&r).map(|a| (r, a)))
    {
        let (record, a) = a;
        if v["trace_log"].is_null() && a.monitors.iter().any(|m| m.starts_with("trace:")) {
            v["trace_log"] = serde_json::json!(crate::monitor::trace_log(&record));
        }
        v["attached_monitors"] = serde_json::to_value(&a).unwrap_or_default();
    }
    Ok(v)
}

/// If template box `name` was removed while it had clones and none is left,
/// wait for it to go: its init leaves once its last clone has (it checks
/// twice a second), and its monitor then releases its network address and
/// removes its record. Without this, `rm -f` of the last clone returned while
/// the template still held its address, and a `network rm` right after was
/// refused. Best effort: a monitor that is dead is cleaned up after here.
fn settle_removed_template(reg: &Registry, name: &str) {
    let Ok(t) = reg.load(name) else { return };
    let removed = t.state.template.as_ref().is_some_and(|i| i.removed);
    if !removed || !crate::template::clones_of(reg, name).is_ok_and(|c| c.is_empty()) {
        return;
    }
    let gone = || reg.load(name).map_or(true, |r| r.state.id != t.state.id);
    if !plain::wait_until(Duration::from_secs(10), gone) {
        if let Ok(r) = reg.load(name) {
            if r.state.effective_status() == Status::Dead {
                let cleaned = plain::cleanup_dead(reg, &r).and_then(|()| reg.remove(&r));
                crate::diag::warn_on_err(Some(name), "cleaning up a removed template", cleaned);
            }
        }
    }
    // A template that was itself a clone (of a template removed meanwhile,
    // kept for it) was that template's last clone perhaps: it goes too, and
    // is waited for the same way (`rm -f` of a whole chain returns once all
    // of it is gone, in whatever order it was named).
    if let Some(src) = &t.spec.clone_of {
        if gone() {
            settle_removed_template(reg, &src.template_box);
        }
    }
}
