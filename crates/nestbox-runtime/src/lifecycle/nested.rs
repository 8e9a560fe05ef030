//! A box started inside another box's pid namespace: a clone shell, whose first
//! process is created in its template's pid namespace, in a user namespace that
//! maps the template's ids to themselves. The monitor needs these from the
//! template's record; they live here, below the templates layer, so that the
//! life of a box never imports templates.

use std::os::fd::AsFd;

use nestbox_isolation::idmap::{IdMap, IdRange};

use crate::registry::{BoxRecord, Registry};
use crate::{Result, RuntimeError};

/// The template box behind a clone shell being started.
pub fn load_template(reg: &Registry, box_name: &str) -> Result<BoxRecord> {
    let record = reg.load(box_name)?;
    match (&record.state.template, record.state.init) {
        (Some(_), Some(init)) if init.alive() => Ok(record),
        _ => Err(RuntimeError::WrongState {
            name: box_name.to_string(),
            problem: "is not a live template".into(),
        }),
    }
}

/// What a clone shell of template `t` gets: a user namespace mapping every id of
/// the template's to itself (so the template's process, owner of that namespace,
/// may enter it), the host owner of its layers, and the template's setns cookie.
#[allow(clippy::type_complexity)]
pub fn shell_identity(
    t: &BoxRecord,
) -> Result<(Option<IdMap>, Option<(u32, u32)>, Option<[u64; 2]>)> {
    let identity = |r: Option<IdRange>| match r {
        Some(r) => IdRange {
            inside: r.inside,
            outside: r.inside,
            count: r.count,
        },
        None => IdRange {
            inside: 0,
            outside: 0,
            count: u32::MAX,
        },
    };
    let map = IdMap {
        uid: identity(t.state.idmap.map(|m| m.uid)),
        gid: identity(t.state.idmap.map(|m| m.gid)),
    };
    Ok((Some(map), root_ids(t), t.state.setns_cookie))
}

/// The (uid, gid) that live box `r`'s root is in this nestbox's user
/// namespace (the host's, or the box's that nestbox runs in): its id map's
/// outside ids. A clone's map is the identity over its template's ids, in
/// its template's user namespace, so its root is its template's root: read
/// from its init's credentials (its init runs as its root), and from its map
/// should its init be gone.
pub fn root_ids(r: &BoxRecord) -> Option<(u32, u32)> {
    let mapped = r.state.idmap.map(|m| m.host_root());
    let (Some(_), Some(init)) = (&r.spec.clone_of, r.state.init) else {
        return mapped;
    };
    let Ok(status) = std::fs::read_to_string(format!("/proc/{}/status", init.pid)) else {
        return mapped;
    };
    let real = |key: &str| -> Option<u32> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    match (real("Uid:"), real("Gid:")) {
        (Some(uid), Some(gid)) if init.alive() => Some((uid, gid)),
        _ => mapped,
    }
}

/// Make the calling (single-threaded) process create its next children in the pid
/// namespace of template `t`'s init, until the guard is left or dropped.
pub fn enter_pid_namespace_of(t: &BoxRecord) -> Result<nestbox_sys::ns::NsGuard> {
    let (ns, path) = open_pid_namespace_of(t)?;
    nestbox_sys::ns::NsGuard::enter(ns.as_fd(), nestbox_sys::ns::Namespace::Pid)
        .map_err(RuntimeError::sys(format!("setns({path})")))
}

/// The pid namespace of template `t`'s init, open, with its path.
pub fn open_pid_namespace_of(t: &BoxRecord) -> Result<(std::fs::File, String)> {
    let init = t
        .state
        .init
        .ok_or_else(|| RuntimeError::NotRunning(t.name().to_string()))?;
    let path = format!("/proc/{}/ns/pid", init.pid);
    match std::fs::File::open(&path) {
        Ok(ns) => Ok((ns, path)),
        Err(e) if init.alive() => Err(RuntimeError::io("open", &path)(e)),
        // Removed since it was loaded: its last clone has gone.
        Err(_) => Err(RuntimeError::TemplateRemoved(t.template_name().to_string())),
    }
}

/// How deep Linux nests pid namespaces (`MAX_PID_NS_LEVEL`).
const MAX_PID_NS_LEVEL: usize = 32;

/// Refuse a box (a template, or one about to be frozen into one) whose pid
/// namespace is as deep as Linux nests them: a clone's is made below its
/// template's, so a line of clones of clones (an E2B sandbox forked again
/// and again) ends there. Counted from this
/// process's `/proc` (the host's, unless nestbox itself runs in a box, where
/// the limit comes sooner and the fork fails as the kernel says).
pub fn refuse_too_deep(t: &BoxRecord) -> Result<()> {
    let Some(init) = t.state.init else {
        return Ok(());
    };
    let dir = std::path::PathBuf::from(format!("/proc/{}", init.pid));
    let levels = crate::process::ns_pids(&dir).map_or(0, |p| p.len().saturating_sub(1));
    if levels < MAX_PID_NS_LEVEL {
        return Ok(());
    }
    Err(RuntimeError::Unsupported {
        name: t.name().to_string(),
        problem: format!(
            "is a clone {levels} pid namespaces deep, and Linux nests them at most {MAX_PID_NS_LEVEL} deep: it cannot be cloned again (clone the template it came from instead)"
        ),
    })
}
