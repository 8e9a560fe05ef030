//! The process tree of a template box, and the order in which a clone re-creates
//! it: every process with the same pid in the clone's pid namespace, the same
//! parent, session and process group.
//!
//! A process whose parent is the box's init is forked from its own template
//! process (the remote fork of fork.rs: its memory shared copy-on-write with
//! the template). Any other process must be a child of its parent's clone, so
//! it is forked by that clone (`clone3` with `set_tid`) and then made a copy
//! of its own template process. Sessions and groups follow from the order:
//! a process that leads its session calls `setsid`, one that leads its group
//! `setpgid(0, 0)`, one that belongs to another process's group joins it
//! after that group's leader exists; everything else is inherited from the
//! parent's clone, as the kernel did in the template.
//!
//! Refused, each with one line naming the process: a process whose session is
//! neither its own nor its parent's (its parent changed session after the
//! fork), and a process group whose leader is not in the box.
//!
//! Two roots are read: a box's ([`read_box`]: its processes are the
//! descendants of nestbox's init, pid [`INIT_PID`], which is not one of
//! them), and a pid namespace's own ([`read_pid_namespace`]: a tree whose
//! pid 1 is one of its processes, the program of an OCI container started
//! cold, whose parent is outside the namespace, [`OUTSIDE_PID`]). A process
//! whose parent is the root's parent ([`INIT_PID`] in a box, [`OUTSIDE_PID`]
//! for a namespace) is made from outside (a remote fork, or a restore stub);
//! any other by its parent.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::{RemoteError, Result};
use crate::procfs::Status;

/// The pid of a box's init in its own pid namespace.
pub const INIT_PID: i32 = 1;

/// The parent of a pid namespace's pid 1 as the namespace sees it (0: not in
/// the namespace). A tree read by [`read_pid_namespace`] has its pid 1 as a
/// child of this.
pub const OUTSIDE_PID: i32 = 0;

/// One process of a template box, as its own pid namespace sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoxProcess {
    /// Host pid.
    pub host_pid: i32,
    /// Pid in the box's pid namespace.
    pub pid: i32,
    /// Parent's pid in the box's namespace ([`INIT_PID`] for the box's init).
    pub ppid: i32,
    /// Session id in the box's namespace.
    pub sid: i32,
    /// Process group id in the box's namespace.
    pub pgid: i32,
}

/// How a process of the clone comes to exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Remote fork of its template process (its parent is the box's init).
    RemoteFork,
    /// Forked by the clone of its parent (box pid), then made a copy of its
    /// template process.
    ForkedBy(i32),
}

/// What the new process does about its session and group once it exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Membership {
    /// Keeps what it inherited.
    Inherit,
    /// `setsid()`: leads a new session (and a group) of its own.
    NewSession,
    /// `setpgid(0, 0)`: leads a new group in its session.
    OwnGroup,
    /// `setpgid(0, pgid)`: joins the existing group `pgid`.
    JoinGroup(i32),
}

/// One step of re-creating the tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    pub process: BoxProcess,
    pub origin: Origin,
    pub membership: Membership,
}

/// Read the processes `host_pids` of a box whose init has host pid `init`.
///
/// # Errors
/// A process that went, or whose `status` cannot be read or parsed; a parent
/// outside the box.
pub fn read_box(init: i32, host_pids: &[i32]) -> Result<Vec<BoxProcess>> {
    read_tree(Some(init), host_pids)
}

/// Read the processes `host_pids` of a pid namespace whose pid 1 is one of
/// them (an OCI container started cold): its pid 1's parent, outside the
/// namespace, is read as [`OUTSIDE_PID`].
///
/// # Errors
/// As [`read_box`]; no process with pid 1 in its namespace among them; two
/// processes in different pid namespaces.
pub fn read_pid_namespace(host_pids: &[i32]) -> Result<Vec<BoxProcess>> {
    read_tree(None, host_pids)
}

/// [`read_box`] (`init`: the box's init) or [`read_pid_namespace`] (`None`).
fn read_tree(init: Option<i32>, host_pids: &[i32]) -> Result<Vec<BoxProcess>> {
    let mut raw = Vec::with_capacity(host_pids.len());
    let mut ns_pid_of = BTreeMap::new();
    if let Some(init) = init {
        ns_pid_of.insert(init, INIT_PID);
    }
    let mut namespace = None;
    for &host_pid in host_pids {
        let status = Status::read(host_pid)?;
        let pid = status.innermost_pid()?;
        let last = |key: &str| -> Result<i32> {
            let text = status.get(key)?;
            text.split_whitespace()
                .last()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| {
                    RemoteError::Unclonable(format!("process {host_pid}: bad {key} {text:?}"))
                })
        };
        let host_ppid: i32 = status.decimal("PPid")?;
        ns_pid_of.insert(host_pid, pid);
        if init.is_none() {
            // Every process must be of the one namespace (a process of a
            // namespace nested in it would be read with the wrong pids).
            let depth = status.get("NSpid")?.split_whitespace().count();
            if *namespace.get_or_insert(depth) != depth {
                return Err(RemoteError::Unclonable(format!(
                    "process {host_pid} (pid {pid} in its namespace) is in a pid namespace nested in the container's"
                )));
            }
        }
        raw.push((host_pid, pid, host_ppid, last("NSsid")?, last("NSpgid")?));
    }
    if init.is_none() {
        let root = raw.iter().find(|r| r.1 == INIT_PID).ok_or_else(|| {
            RemoteError::Unclonable("no process of the tree is pid 1 of its pid namespace".into())
        })?;
        ns_pid_of.entry(root.2).or_insert(OUTSIDE_PID);
    }
    raw.into_iter()
        .map(|(host_pid, pid, host_ppid, sid, pgid)| {
            let ppid = *ns_pid_of.get(&host_ppid).ok_or_else(|| {
                RemoteError::Unclonable(if init.is_some() {
                    format!(
                        "process {host_pid} (pid {pid} in its box) has a parent outside the box (host pid {host_ppid})"
                    )
                } else {
                    format!(
                        "process {host_pid} (pid {pid} in its pid namespace) has a parent outside the tree of pid 1 (host pid {host_ppid}): a process that joined the namespace from outside (an exec) cannot be saved"
                    )
                })
            })?;
            Ok(BoxProcess {
                host_pid,
                pid,
                ppid,
                sid,
                pgid,
            })
        })
        .collect()
}

/// The order in which a clone re-creates `processes` (the box's init
/// excluded): parents before children, group leaders before the members that
/// join them.
///
/// # Errors
/// [`RemoteError::Plan`] naming the process for a tree a clone cannot
/// reproduce (see the module documentation).
pub fn plan(processes: &[BoxProcess]) -> Result<Vec<Step>> {
    let by_pid: BTreeMap<i32, &BoxProcess> = processes.iter().map(|p| (p.pid, p)).collect();
    let mut steps = Vec::with_capacity(processes.len());
    // Session and group of each process in the clone once it has been made.
    let mut made: BTreeMap<i32, (i32, i32)> = BTreeMap::new();
    let mut groups: BTreeSet<i32> = BTreeSet::new();
    let mut left: Vec<&BoxProcess> = processes.iter().collect();
    left.sort_by_key(|p| p.pid);
    while !left.is_empty() {
        let before = left.len();
        let mut i = 0;
        while i < left.len() {
            let p = left[i];
            // (A box's init is never in `processes`; a namespace's pid 1 is.)
            let origin = if by_pid.contains_key(&p.ppid) {
                Origin::ForkedBy(p.ppid)
            } else if p.ppid == INIT_PID || p.ppid == OUTSIDE_PID {
                Origin::RemoteFork
            } else {
                return Err(RemoteError::Unclonable(format!(
                    "process {} (pid {} in its box) has a parent (pid {}) that is not in the box",
                    p.host_pid, p.pid, p.ppid
                )));
            };
            // What it inherits: its parent's clone's session and group; a
            // remote fork inherits its template's, which are not in the clone's
            // pid namespace and so must always be made anew.
            let inherited = match origin {
                Origin::RemoteFork => None,
                Origin::ForkedBy(parent) => match made.get(&parent) {
                    Some(&sg) => Some(sg),
                    None => {
                        i += 1;
                        continue;
                    }
                },
            };
            let membership = if p.sid == p.pid {
                Membership::NewSession
            } else if origin == Origin::RemoteFork {
                return Err(RemoteError::Unclonable(format!(
                    "process {} (pid {} in its box) is a child of the box's init but does not lead its own session (session {}): a clone cannot re-create it",
                    p.host_pid, p.pid, p.sid
                )));
            } else if inherited.map(|(sid, _)| sid) != Some(p.sid) {
                return Err(RemoteError::Unclonable(format!(
                    "process {} (pid {} in its box) is in session {}, which is neither its own nor its parent's: a clone cannot re-create it",
                    p.host_pid, p.pid, p.sid
                )));
            } else if p.pgid == p.pid {
                Membership::OwnGroup
            } else if inherited.map(|(_, pgid)| pgid) == Some(p.pgid) {
                Membership::Inherit
            } else if !by_pid.contains_key(&p.pgid) {
                return Err(RemoteError::Unclonable(format!(
                    "process {} (pid {} in its box) is in process group {}, whose leader is not in the box: a clone cannot re-create it",
                    p.host_pid, p.pid, p.pgid
                )));
            } else if groups.contains(&p.pgid) {
                Membership::JoinGroup(p.pgid)
            } else {
                // Its group's leader is made first.
                i += 1;
                continue;
            };
            if membership == Membership::NewSession && p.pgid != p.pid {
                return Err(RemoteError::Unclonable(format!(
                    "process {} (pid {} in its box) leads session {} but is in process group {}: a clone cannot re-create it",
                    p.host_pid, p.pid, p.sid, p.pgid
                )));
            }
            made.insert(p.pid, (p.sid, p.pgid));
            groups.insert(p.pgid);
            steps.push(Step {
                process: *p,
                origin,
                membership,
            });
            left.remove(i);
        }
        if left.len() == before {
            let names: Vec<String> = left.iter().map(|p| p.pid.to_string()).collect();
            return Err(RemoteError::Unclonable(format!(
                "the process tree of the box cannot be re-created in an order that gives every process its group (pids {})",
                names.join(", ")
            )));
        }
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proc(pid: i32, ppid: i32, sid: i32, pgid: i32) -> BoxProcess {
        BoxProcess {
            host_pid: 1000 + pid,
            pid,
            ppid,
            sid,
            pgid,
        }
    }

    #[test]
    fn one_process_leading_its_session_is_remote_forked_and_calls_setsid() {
        let steps = plan(&[proc(2, 1, 2, 2)]).unwrap();
        assert_eq!(steps.len(), 1);
        assert_eq!(steps[0].origin, Origin::RemoteFork);
        assert_eq!(steps[0].membership, Membership::NewSession);
    }

    #[test]
    fn prefork_workers_are_forked_by_the_masters_clone_and_inherit() {
        let steps = plan(&[proc(4, 2, 2, 2), proc(2, 1, 2, 2), proc(3, 2, 2, 2)]).unwrap();
        let order: Vec<i32> = steps.iter().map(|s| s.process.pid).collect();
        assert_eq!(order, [2, 3, 4]);
        assert_eq!(steps[1].origin, Origin::ForkedBy(2));
        assert_eq!(steps[1].membership, Membership::Inherit);
    }

    #[test]
    fn a_shells_background_job_leads_its_own_group() {
        // sh (2) with a job-control child (3) in group 3 and a grandchild (4)
        // in that group.
        let steps = plan(&[proc(2, 1, 2, 2), proc(3, 2, 2, 3), proc(4, 3, 2, 3)]).unwrap();
        assert_eq!(steps[1].membership, Membership::OwnGroup);
        assert_eq!(steps[2].membership, Membership::Inherit);
    }

    #[test]
    fn group_members_wait_for_their_leader_made_later_in_pid_order() {
        // 3 joins the group of its younger sibling 5 (a pipeline's first
        // process is the leader in shells that number it so).
        let steps = plan(&[proc(2, 1, 2, 2), proc(3, 2, 2, 5), proc(5, 2, 2, 5)]).unwrap();
        let order: Vec<i32> = steps.iter().map(|s| s.process.pid).collect();
        assert_eq!(order, [2, 5, 3]);
        assert_eq!(steps[2].membership, Membership::JoinGroup(5));
    }

    #[test]
    fn a_session_not_its_own_nor_its_parents_is_refused_naming_the_process() {
        // 3 was forked before its parent called setsid.
        let err = plan(&[proc(2, 1, 2, 2), proc(3, 2, 9, 9)]).unwrap_err();
        assert!(err.to_string().contains("pid 3 in its box"), "{err}");
        assert!(err.to_string().contains("session 9"), "{err}");
    }

    #[test]
    fn a_group_without_its_leader_is_refused() {
        let err = plan(&[proc(2, 1, 2, 2), proc(3, 2, 2, 7)]).unwrap_err();
        assert!(err.to_string().contains("process group 7"), "{err}");
    }

    #[test]
    fn a_parent_outside_the_box_is_refused() {
        let err = plan(&[proc(3, 8, 3, 3)]).unwrap_err();
        assert!(err.to_string().contains("not in the box"), "{err}");
    }

    #[test]
    fn a_pid_namespaces_pid_1_is_made_from_outside_and_its_children_by_it() {
        // An OCI container started cold: sh (1, its own session after
        // setsid) with a child (7) in its group and a job (9) leading one.
        let steps = plan(&[
            proc(7, 1, 1, 1),
            proc(1, OUTSIDE_PID, 1, 1),
            proc(9, 1, 1, 9),
        ])
        .unwrap();
        let order: Vec<i32> = steps.iter().map(|s| s.process.pid).collect();
        assert_eq!(order, [1, 7, 9]);
        assert_eq!(steps[0].origin, Origin::RemoteFork);
        assert_eq!(steps[0].membership, Membership::NewSession);
        assert_eq!(steps[1].origin, Origin::ForkedBy(1));
        assert_eq!(steps[1].membership, Membership::Inherit);
        assert_eq!(steps[2].membership, Membership::OwnGroup);
    }

    #[test]
    fn the_pid_namespace_of_this_process_reads_with_pid_1_outside() {
        // This test's own process tree is in the initial pid namespace,
        // whose pid 1 is not one of its processes: refused, saying so.
        let me = std::process::id() as i32;
        let err = read_pid_namespace(&[me]).unwrap_err();
        assert!(err.to_string().contains("pid 1"), "{err}");
    }

    #[test]
    fn a_root_in_inits_session_cannot_be_recreated() {
        // The remote fork's session is the template's: only setsid gives it one
        // in the clone, and that needs the process to lead its session.
        let err = plan(&[proc(2, 1, 1, 1)]).unwrap_err();
        assert!(err.to_string().contains("session 1"), "{err}");
    }
}
