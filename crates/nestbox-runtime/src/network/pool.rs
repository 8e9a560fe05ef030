//! A pool of network namespaces made ahead of time for bridge-mode boxes, so
//! that creating the namespace and its veth pair, addressing it and giving it
//! its bandwidth class (the largest part of a box's network set-up) happen off
//! the box's start path.
//!
//! Each entry is a directory under `RUN/netpool/` holding `ns`, a bind mount of
//! the namespace (which keeps it alive with no process in it), and `pool-id`,
//! the id its address is leased under. An entry is made under a `.make-` name
//! and renamed into place once complete; a box claims one by renaming it to
//! `box-ID`, takes its address over under its own id and names
//! ([`nestbox_net::Network::reassign`]), and its first process joins the
//! namespace instead of creating one. When the box ends the mount is removed
//! and the kernel destroys the namespace with its veth pair.
//!
//! Only boxes with the default attachment (no published port, no rate,
//! reservation, share or ingress cap) and without a user namespace use the
//! pool; the others get a namespace of their own at start, as before.

use std::fs;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use nestbox_sys::ns::{Namespace, NsGuard};
use nix::fcntl::Flock;

use crate::paths::Roots;
use crate::spec::{BoxSpec, NetworkMode};
use crate::{Result, RuntimeError};

/// Pool size when none was set: the machine-wide root keeps two namespaces
/// ready; other roots (`--root`: tests, nested nestbox) keep none unless told.
const DEFAULT_SIZE_SYSTEM: usize = 2;

/// Largest pool size accepted.
pub const MAX_SIZE: usize = 64;

const MOUNT_FILE: &str = "ns";
const ID_FILE: &str = "pool-id";
const MAKING: &str = ".make-";
const CLAIMED: &str = "box-";

fn pool_dir(roots: &Roots) -> PathBuf {
    roots.run.join("netpool")
}

fn size_file(roots: &Roots) -> PathBuf {
    roots.lib.join("network-pool-size")
}

/// The pool size of `roots`' default network. A nestbox in a user namespace
/// (inside a nest box) keeps none unless told to: its boxes all have user
/// namespaces of their own, which a pooled namespace is not for.
pub fn size(roots: &Roots) -> usize {
    match fs::read_to_string(size_file(roots)) {
        Ok(s) => s.trim().parse().unwrap_or(0),
        Err(_)
            if crate::network::is_system_root(roots)
                && !nestbox_isolation::idmap::in_user_namespace() =>
        {
            DEFAULT_SIZE_SYSTEM
        }
        Err(_) => 0,
    }
}

/// Set the pool size of `roots`' default network (entries beyond it are
/// removed, missing ones are made by the next [`fill`]).
pub fn set_size(roots: &Roots, n: usize) -> Result<()> {
    if n > MAX_SIZE {
        return Err(RuntimeError::InvalidInput(format!(
            "network pool size {n} is too large (at most {MAX_SIZE})"
        )));
    }
    let path = size_file(roots);
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(RuntimeError::io("mkdir", dir))?;
    }
    fs::write(&path, format!("{n}\n")).map_err(RuntimeError::io("write", &path))?;
    let _lock = lock(roots, true)?;
    for entry in ready(roots).into_iter().skip(n) {
        remove_entry(roots, &entry);
    }
    Ok(())
}

/// Whether a box of `spec` may take a namespace from the pool.
pub fn eligible(spec: &BoxSpec) -> bool {
    spec.network.mode == NetworkMode::Bridge
        && spec.network.name.is_none()
        && !spec.network.has_bridge_options()
        && !spec.userns
        && spec.clone_of.is_none()
}

fn lock(roots: &Roots, wait: bool) -> Result<Option<Flock<fs::File>>> {
    let dir = pool_dir(roots);
    fs::create_dir_all(&dir).map_err(RuntimeError::io("mkdir", &dir))?;
    crate::state::lock_file(&dir.join(".lock"), wait)
}

/// Ready entries, oldest name first.
fn ready(roots: &Roots) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = fs::read_dir(pool_dir(roots))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            !n.starts_with('.') && !n.starts_with(CLAIMED)
        })
        .map(|e| e.path())
        .collect();
    out.sort();
    out
}

/// How many namespaces are ready.
pub fn ready_count(roots: &Roots) -> usize {
    ready(roots).len()
}

/// Make entries until the pool holds its size; the number made. Stops early,
/// without error, if the pool is being changed by someone else.
pub fn fill(roots: &Roots) -> Result<usize> {
    let mut made = 0;
    loop {
        let Some(_lock) = lock(roots, true)? else {
            return Ok(made);
        };
        // The network was removed (`network rm`): its pool with it.
        if ready(roots).len() >= size(roots) || crate::network::view(roots)?.is_none() {
            return Ok(made);
        }
        make_entry(roots)?;
        made += 1;
    }
}

fn make_entry(roots: &Roots) -> Result<()> {
    let suffix = crate::registry::new_id();
    let pool_id = format!("netpool-{suffix}");
    let dir = pool_dir(roots).join(format!("{MAKING}{suffix}"));
    let result = (|| -> Result<()> {
        fs::create_dir(&dir).map_err(RuntimeError::io("mkdir", &dir))?;
        fs::write(dir.join(ID_FILE), &pool_id).map_err(RuntimeError::io("write", &dir))?;
        let target = dir.join(MOUNT_FILE);
        fs::File::create(&target).map_err(RuntimeError::io("create", &target))?;
        let ns = nestbox_net::netns::create()?;
        nestbox_sys::mount::bind_nsfs(ns.as_fd(), &target).map_err(RuntimeError::sys(format!(
            "bind-mount {}",
            target.display()
        )))?;
        let network = crate::network::open(roots)?;
        let lease = network.allocate(&pool_id, &[])?;
        network.attach(&lease, ns.as_fd(), &nestbox_net::AttachOptions::default())?;
        let ready = pool_dir(roots).join(&suffix);
        fs::rename(&dir, &ready).map_err(RuntimeError::io("rename", &dir))
    })();
    if result.is_err() {
        remove_entry(roots, &dir);
    }
    result
}

/// Undo an entry: its lease and attachment, its mount (the namespace and veth
/// go with it) and its directory. Best effort: an entry half undone is not
/// `intact` and is undone again by the next `clear` or `gc`, so the removal
/// steps' errors (the mount or a file already gone) are ignored.
fn remove_entry(roots: &Roots, dir: &Path) {
    if let Ok(id) = fs::read_to_string(dir.join(ID_FILE)) {
        if let Ok(Some(net)) = crate::network::view(roots) {
            crate::diag::warn_on_err(
                None,
                "releasing a pooled namespace's address",
                net.detach_exited(id.trim()),
            );
        }
    }
    let target = dir.join(MOUNT_FILE);
    let _ = nestbox_sys::mount::detach(&target);
    let _ = fs::remove_file(&target);
    let _ = fs::remove_file(dir.join(ID_FILE));
    let _ = fs::remove_dir(dir);
}

/// A namespace taken from the pool by a box.
#[derive(Debug)]
pub struct Claimed {
    /// The network namespace, for the box's first process to join.
    pub netns: OwnedFd,
    /// What `inspect` shows of the box's network.
    pub attachment: serde_json::Value,
}

/// Take a ready namespace for box `box_id`, named `names` on the network.
/// `None` when the pool is empty or busy (being filled or changed): the box
/// then makes its own.
pub fn claim(roots: &Roots, box_id: &str, names: &[&str]) -> Result<Option<Claimed>> {
    if !pool_dir(roots).exists() {
        return Ok(None);
    }
    let Some(_lock) = lock(roots, false)? else {
        return Ok(None);
    };
    let Some(entry) = ready(roots).into_iter().next() else {
        return Ok(None);
    };
    let claimed = pool_dir(roots).join(format!("{CLAIMED}{box_id}"));
    fs::rename(&entry, &claimed).map_err(RuntimeError::io("rename", &entry))?;
    let result = (|| -> Result<Claimed> {
        let pool_id = fs::read_to_string(claimed.join(ID_FILE))
            .map_err(RuntimeError::io("read", &claimed))?;
        let target = claimed.join(MOUNT_FILE);
        let netns: OwnedFd = fs::File::open(&target)
            .map_err(RuntimeError::io("open", &target))?
            .into();
        let net = crate::network::view(roots)?
            .ok_or_else(|| RuntimeError::Failed("the network of the pool is gone".to_string()))?;
        let attachment = net.reassign(pool_id.trim(), box_id, names)?;
        Ok(Claimed {
            netns,
            attachment: serde_json::to_value(&attachment).unwrap_or_default(),
        })
    })();
    match result {
        Ok(c) => Ok(Some(c)),
        Err(e) => {
            remove_entry(roots, &claimed);
            Err(e)
        }
    }
}

/// Remove the pool namespace box `box_id` holds, if any (its end, or its start
/// failed): the kernel then destroys the namespace and its veth.
pub fn release(roots: &Roots, box_id: &str) {
    let dir = pool_dir(roots).join(format!("{CLAIMED}{box_id}"));
    if dir.exists() {
        // Best effort, as in `remove_entry`: `gc` clears what is left. The
        // address is the box's (a claim cut short before it moved the address
        // over leaves it under the pool id: `gc` releases a pool id no entry
        // names, see `clear_then`).
        let target = dir.join(MOUNT_FILE);
        let _ = nestbox_sys::mount::detach(&target);
        let _ = fs::remove_file(&target);
        let _ = fs::remove_file(dir.join(ID_FILE));
        let _ = fs::remove_dir(&dir);
    }
}

/// Remove every leftover of the pool: half-made entries (their maker died:
/// a live maker would hold the lock), entries held by a box not in `live`,
/// and ready entries whose namespace mount is gone. Ready entries that are
/// intact stay: they are the pool, not leftovers. Then, still under the
/// pool's lock (no entry is made or claimed meanwhile), run `then` with the
/// test of whether a pool id's address is held by an entry: a pool id's lease
/// that no entry names is a leftover (an entry whose removal failed to
/// release it). If a ready entry was removed, a refill is started.
pub fn clear_then<T>(
    roots: &Roots,
    live: &[String],
    then: impl FnOnce(&dyn Fn(&str) -> bool) -> Result<T>,
) -> Result<T> {
    if !pool_dir(roots).exists() {
        // No pool was ever made here (or its network was removed with it):
        // a pool id leased now belongs to a refill just starting.
        return then(&is_pool_id);
    }
    let lock = lock(roots, true)?;
    let before = ready(roots).len();
    clear_locked(roots, Some(live));
    let broken = before - ready(roots).len();
    let held = held_pool_ids(roots);
    let result = then(&|id: &str| held.iter().any(|h| h == id));
    drop(lock);
    if broken > 0 {
        spawn_fill(roots);
    }
    result
}

/// The pool ids named by the entries of the pool (ready, being made, or
/// claimed by a box that may not have moved the address over yet).
fn held_pool_ids(roots: &Roots) -> Vec<String> {
    fs::read_dir(pool_dir(roots))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| fs::read_to_string(e.path().join(ID_FILE)).ok())
        .map(|id| id.trim().to_string())
        .collect()
}

/// Whether the ready entry `dir` still holds its namespace.
fn intact(dir: &Path) -> bool {
    use nix::sys::statfs::{statfs, NSFS_MAGIC};
    fs::read_to_string(dir.join(ID_FILE)).is_ok()
        && statfs(&dir.join(MOUNT_FILE)).is_ok_and(|s| s.filesystem_type() == NSFS_MAGIC)
}

/// Remove entries: with `live`, the leftovers [`clear`] describes; without,
/// all of them.
fn clear_locked(roots: &Roots, live: Option<&[String]>) -> usize {
    let mut removed = 0;
    for e in fs::read_dir(pool_dir(roots))
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().to_string();
        if name == ".lock" {
            continue;
        }
        if let Some(live) = live {
            let keep = match name.strip_prefix(CLAIMED) {
                Some(id) => live.iter().any(|l| l == id),
                None => !name.starts_with('.') && intact(&e.path()),
            };
            if keep {
                continue;
            }
        }
        remove_entry(roots, &e.path());
        removed += 1;
    }
    removed
}

/// Remove the whole pool and then, still holding the pool's lock so that no
/// refill can make an entry meanwhile, run `remove_network`.
pub fn remove_with(roots: &Roots, remove_network: impl FnOnce() -> Result<()>) -> Result<()> {
    let lock = lock(roots, true)?;
    clear_locked(roots, None);
    remove_network()?;
    drop(lock);
    // The pool's directory goes with the network if nothing else is in it
    // (a refill's entry may be); a leftover lock file is harmless.
    let _ = fs::remove_file(pool_dir(roots).join(".lock"));
    let _ = fs::remove_dir(pool_dir(roots));
    Ok(())
}

/// The pool ids still holding addresses (for refusing `network rm` only for
/// boxes, not for the pool).
pub fn is_pool_id(id: &str) -> bool {
    id.starts_with("netpool-")
}

/// Refill the pool in a detached process, off the caller's path (see
/// [`crate::process::spawn_refill`]: delayed, at idle priority).
pub fn spawn_fill(roots: &Roots) {
    if ready_count(roots) >= size(roots) {
        return;
    }
    crate::process::spawn_refill(|| fill(roots).map(|_| ()));
}

/// Join `netns` on the calling thread; the guard holds the namespace it was in,
/// for [`leave`] (a forked child that keeps `netns` calls `stay` on it). A
/// process forked meanwhile starts in `netns`.
pub fn enter(netns: &OwnedFd) -> Result<NsGuard> {
    NsGuard::enter(netns.as_fd(), Namespace::Net).map_err(RuntimeError::sys(
        "setns(CLONE_NEWNET) into a pooled namespace",
    ))
}

/// Return to the namespace [`enter`] left; without it every later netlink call
/// of this process would act on the box's namespace.
pub fn leave(own: NsGuard) -> Result<()> {
    own.leave().map_err(RuntimeError::sys(
        "setns(CLONE_NEWNET) back to the host's namespace",
    ))
}
