//! The state of a process that a process of a clone does not get from its
//! parent's clone when it is forked by it: working directory, umask, resource
//! limits, signal dispositions, name, personality. Read from the template
//! process and given to the new process, so that a child in a template's
//! process tree (a prefork worker, a shell's job that ran `exec`) continues
//! with its own state, not its parent's.
//!
//! Dispositions are read by an injected batch of `rt_sigaction` calls in the
//! template process (there is no `/proc` file for them) in a scratch area
//! mapped there and unmapped again; everything else comes from `/proc` and
//! `prlimit`. Credentials, `no_new_privs` and the seccomp filters are not set
//! here: a child inherits them from its parent's clone, and a process whose
//! differ from its parent's is refused ([`ProcessState::check_inherits`]).

use std::path::PathBuf;

use crate::batch::Batch;
use crate::error::{RemoteError, Result};
use crate::memory::Scratch;
use crate::procfs::{self, Status};
use crate::tracee::Tracee;

/// Bytes of the kernel's `struct sigaction` on x86_64 (handler, flags,
/// restorer, mask).
const KERNEL_SIGACTION: usize = 32;
/// `sizeof(sigset_t)` as the kernel takes it.
const SIGSET_SIZE: u64 = 8;
/// Signals with a disposition (1..=64 but SIGKILL and SIGSTOP).
fn signals() -> impl Iterator<Item = i32> {
    (1..=64).filter(|&s| s != libc::SIGKILL && s != libc::SIGSTOP)
}

/// Resource limits (`RLIMIT_*` 0..16).
const RLIMITS: i32 = 16;

/// What a forked process of a clone is given of its template process.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProcessState {
    /// Working directory (resolved in the clone's root).
    pub cwd: PathBuf,
    /// File mode creation mask.
    pub umask: u32,
    /// Name of the main thread (`comm`).
    pub comm: String,
    /// `(resource, soft, hard)` for every resource limit.
    pub rlimits: Vec<(i32, u64, u64)>,
    /// `(signal, kernel sigaction bytes)` for every signal.
    pub sigactions: Vec<(i32, [u8; KERNEL_SIGACTION])>,
    /// Credentials and confinement lines of `/proc/PID/status` that a child
    /// inherits and must equal its parent's (Uid, Gid, Groups, NoNewPrivs,
    /// Seccomp, Seccomp_filters).
    inherited: Vec<(String, String)>,
}

const INHERITED: [&str; 6] = [
    "Uid",
    "Gid",
    "Groups",
    "NoNewPrivs",
    "Seccomp",
    "Seccomp_filters",
];

/// Every resource limit of `pid` as `/proc/PID/limits` shows it, in the
/// order of the resource numbers (the kernel lists them so): `(soft, hard)`,
/// `unlimited` as `RLIM_INFINITY`.
fn read_limits(pid: i32) -> Result<Vec<(u64, u64)>> {
    let text = procfs::read_to_string(&procfs::proc_path(pid, "limits"))?;
    parse_limits(&text).ok_or_else(|| {
        RemoteError::Unclonable(format!("process {pid}: /proc/{pid}/limits does not parse"))
    })
}

fn parse_limits(text: &str) -> Option<Vec<(u64, u64)>> {
    let value = |v: &str| match v {
        "unlimited" => Some(u64::MAX),
        n => n.parse().ok(),
    };
    text.lines()
        .skip(1)
        .map(|l| {
            // The name is the first 26 columns ("Max open files" and such).
            let mut f = l.get(26..)?.split_whitespace();
            Some((value(f.next()?)?, value(f.next()?)?))
        })
        .collect()
}

impl ProcessState {
    /// Read the state of the stopped `template` process (its registers are put
    /// back afterwards).
    ///
    /// # Errors
    /// `/proc` or an injected call failed; the template is left as it was.
    pub fn capture(template: &mut Tracee) -> Result<ProcessState> {
        let pid = template.pid();
        let status = Status::read(pid)?;
        let umask = u32::from_str_radix(status.get("Umask")?, 8).map_err(|_| {
            RemoteError::Unclonable(format!("process {pid}: bad Umask in its status"))
        })?;
        let inherited = INHERITED
            .iter()
            .map(|key| Ok((key.to_string(), status.get(key).unwrap_or("").to_string())))
            .collect::<Result<Vec<_>>>()?;
        let comm = procfs::read_to_string(&procfs::proc_path(pid, "comm"))?
            .trim_end_matches('\n')
            .to_string();
        let mut rlimits = Vec::with_capacity(RLIMITS as usize);
        for resource in 0..RLIMITS {
            let (soft, hard) = match nestbox_sys::process::get_rlimit(pid, resource) {
                Ok(l) => l,
                // Another uid's limits need CAP_SYS_RESOURCE for prlimit,
                // which this machine's root may lack; /proc shows them.
                Err(nix::errno::Errno::EPERM) => read_limits(pid)?
                    .get(resource as usize)
                    .copied()
                    .ok_or_else(|| {
                        RemoteError::Unclonable(format!(
                            "process {pid}: /proc/{pid}/limits has no line for resource {resource}"
                        ))
                    })?,
                Err(e) => {
                    return Err(RemoteError::Sys {
                        op: "prlimit (read)",
                        pid,
                        source: e.into(),
                    })
                }
            };
            rlimits.push((resource, soft, hard));
        }
        let sigactions = read_sigactions(template)?;
        Ok(ProcessState {
            cwd: procfs::cwd(pid)?,
            umask,
            comm,
            rlimits,
            sigactions,
            inherited,
        })
    }

    /// The value of one of the credential and confinement lines of
    /// `/proc/PID/status` kept (`Uid`, `Gid`, `Groups`, `NoNewPrivs`,
    /// `Seccomp`, `Seccomp_filters`).
    pub fn inherited_line(&self, key: &str) -> Option<&str> {
        self.inherited
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Refuse a process whose credentials or confinement differ from its
    /// parent's (`parent`): its clone, forked by the parent's clone, would
    /// inherit the parent's.
    pub fn check_inherits(&self, pid: i32, parent: &ProcessState) -> Result<()> {
        self.check_inherits_but(pid, parent, &[])
    }

    /// Whether its user, group and supplementary group ids are `parent`'s
    /// (the `Uid`, `Gid` and `Groups` lines read at capture).
    pub fn same_ids(&self, parent: &ProcessState) -> bool {
        self.inherited
            .iter()
            .zip(&parent.inherited)
            .filter(|((key, _), _)| matches!(key.as_str(), "Uid" | "Gid" | "Groups"))
            .all(|((_, mine), (_, theirs))| mine == theirs)
    }

    /// [`Self::check_inherits`], but for the lines `except` (which the caller
    /// re-creates itself: a clone sets a child's user and group ids).
    pub fn check_inherits_but(
        &self,
        pid: i32,
        parent: &ProcessState,
        except: &[&str],
    ) -> Result<()> {
        for ((key, mine), (_, theirs)) in self.inherited.iter().zip(&parent.inherited) {
            if mine != theirs && !except.contains(&key.as_str()) {
                return Err(RemoteError::Unclonable(format!(
                    "process {pid} ({}) has {key} {mine:?} where its parent has {theirs:?}: a clone cannot re-create it",
                    self.comm
                )));
            }
        }
        Ok(())
    }

    /// Give the stopped process `x` (in the clone's namespaces) this state,
    /// through the scratch area mapped in it.
    ///
    /// # Errors
    /// A call failed (the working directory does not exist in the clone's
    /// root, a limit cannot be set), naming it.
    pub(crate) fn apply(&self, x: &mut Tracee, scratch: &mut Scratch) -> Result<()> {
        let pid = x.pid();
        for &(resource, soft, hard) in &self.rlimits {
            nestbox_sys::process::set_rlimit(pid, resource, soft, hard).map_err(|e| {
                RemoteError::Sys {
                    op: "prlimit (write)",
                    pid,
                    source: e.into(),
                }
            })?;
        }
        scratch.reset();
        let cwd = scratch.put_path(x, self.cwd.as_os_str().as_encoded_bytes())?;
        let mut comm = self.comm.as_bytes().to_vec();
        comm.truncate(15);
        let comm = scratch.put_path(x, &comm)?;
        let mut actions = Vec::with_capacity(self.sigactions.len());
        for (sig, bytes) in &self.sigactions {
            actions.push((*sig, scratch.put(x, bytes)?));
        }
        let mut batch = Batch::new();
        batch.push(
            "chdir",
            format!("to {}", self.cwd.display()),
            libc::SYS_chdir,
            &[cwd],
        );
        batch.push(
            "umask",
            format!("{:o}", self.umask),
            libc::SYS_umask,
            &[u64::from(self.umask)],
        );
        batch.push(
            "prctl(PR_SET_NAME)",
            self.comm.clone(),
            libc::SYS_prctl,
            &[libc::PR_SET_NAME as u64, comm],
        );
        for (sig, addr) in actions {
            batch.push(
                "rt_sigaction",
                format!("signal {sig}"),
                libc::SYS_rt_sigaction,
                &[sig as u64, addr, 0, SIGSET_SIZE],
            );
        }
        batch.run(x, scratch)?;
        Ok(())
    }
}

/// Every signal's disposition in the stopped `template`, by an injected batch
/// of `rt_sigaction(sig, NULL, &old)` into a scratch area mapped for it.
fn read_sigactions(template: &mut Tracee) -> Result<Vec<(i32, [u8; KERNEL_SIGACTION])>> {
    template.find_syscall_insn()?;
    let mut scratch = Scratch::map(template)?;
    let result = (|| {
        let sigs: Vec<i32> = signals().collect();
        let buf = scratch.reserve(sigs.len() * KERNEL_SIGACTION)?;
        let mut batch = Batch::new();
        for (i, sig) in sigs.iter().enumerate() {
            batch.push(
                "rt_sigaction",
                format!("reading the disposition of signal {sig}"),
                libc::SYS_rt_sigaction,
                &[
                    *sig as u64,
                    0,
                    buf + (i * KERNEL_SIGACTION) as u64,
                    SIGSET_SIZE,
                ],
            );
        }
        batch.run(template, &mut scratch)?;
        let mut raw = vec![0u8; sigs.len() * KERNEL_SIGACTION];
        template.read_mem(buf, &mut raw)?;
        Ok(sigs
            .iter()
            .zip(raw.chunks_exact(KERNEL_SIGACTION))
            .map(|(sig, bytes)| {
                let mut action = [0u8; KERNEL_SIGACTION];
                action.copy_from_slice(bytes);
                (*sig, action)
            })
            .collect())
    })();
    let unmapped = scratch.unmap(template);
    let restored = template.restore_regs();
    let actions = result?;
    unmapped?;
    restored?;
    Ok(actions)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_limits_parse_in_resource_order() {
        let me = std::process::id() as i32;
        let mine = procfs::read_to_string(&procfs::proc_path(me, "limits")).unwrap();
        let parsed = parse_limits(&mine).unwrap();
        assert_eq!(parsed.len(), RLIMITS as usize);
        for (resource, limits) in parsed.iter().enumerate() {
            let own = nestbox_sys::process::get_rlimit(me, resource as i32).unwrap();
            assert_eq!(*limits, own, "resource {resource}");
        }
    }
}
