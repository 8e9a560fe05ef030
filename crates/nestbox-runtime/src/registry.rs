//! The registry of boxes under one root: one record directory per box name
//! (spec, state, lock, root mount point) and one data directory per box id
//! (writable layers, log). Records appear atomically (built under a temporary
//! name, then renamed without replacing) and are changed under a per-box lock,
//! so concurrent commands on different boxes never interfere and two commands
//! racing for one name cannot both win.

use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

use crate::paths::Roots;
use crate::spec::BoxSpec;
use crate::state::{read_json, write_json, BoxState};
use crate::{Result, RuntimeError};

/// Access to the boxes of one nestbox root.
#[derive(Debug, Clone)]
pub struct Registry {
    roots: Roots,
}

/// A box as recorded: its spec and its current state.
#[derive(Debug, Clone)]
pub struct BoxRecord {
    /// The spec it was created from.
    pub spec: BoxSpec,
    /// Its current state.
    pub state: BoxState,
    run_dir: PathBuf,
    lib_dir: PathBuf,
}

impl BoxRecord {
    /// The box name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }
    /// The name clones of this box are made from: its template name if it was
    /// frozen (`freeze --as`), its box name otherwise.
    pub fn template_name(&self) -> &str {
        self.state
            .template
            .as_ref()
            .map_or(self.name(), |t| t.name.as_str())
    }
    /// Whether this is a clone waiting in its template's pool (forked ahead of
    /// time, stopped, under a name with the reserved pool prefix) rather than a
    /// box of its own: claiming it is renaming it.
    pub fn is_pooled(&self) -> bool {
        self.spec.clone_of.is_some() && self.name().starts_with(crate::spec::POOL_NAME_PREFIX)
    }
    /// Whether this is a box shell waiting in the pool of shells (the
    /// lifecycle layer's `shell` module), not a box of its own yet.
    pub fn is_shell(&self) -> bool {
        self.spec.name.starts_with("pool.shell.") || self.spec.name.starts_with("pool.mk.")
    }
    /// The name prefix of the pooled clones of this box as a template
    /// (`pool.<template id>.`): its pool's records are named so.
    pub fn pool_prefix(&self) -> String {
        format!("{}{}.", crate::spec::POOL_NAME_PREFIX, self.state.id)
    }
    /// The record of this box once renamed to `spec.name` (same id and
    /// data), with `spec` and `state`.
    pub(crate) fn renamed(&self, spec: BoxSpec, state: BoxState) -> BoxRecord {
        let run_dir = self
            .run_dir
            .parent()
            .map(|p| p.join(&spec.name))
            .unwrap_or_else(|| self.run_dir.clone());
        BoxRecord {
            spec,
            state,
            run_dir,
            lib_dir: self.lib_dir.clone(),
        }
    }
    /// Record directory.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }
    /// Data directory (layers, log).
    pub fn lib_dir(&self) -> &Path {
        &self.lib_dir
    }
    /// The output log.
    pub fn log_path(&self) -> PathBuf {
        self.lib_dir.join("log")
    }
    /// The detached monitor's warnings and errors (see [`crate::diag`]).
    pub fn monitor_log_path(&self) -> PathBuf {
        self.lib_dir.join("monitor.log")
    }
    /// Writable layer `index` of the root view: (upper, work). With a disk
    /// (`--disk`) they are on it.
    pub fn layer_dirs(&self, index: usize) -> (PathBuf, PathBuf) {
        let base = match self.spec.disk {
            Some(_) => crate::disk::mount_point(&self.lib_dir),
            None => self.lib_dir.clone(),
        };
        (
            base.join(format!("upper-{index}")),
            base.join(format!("work-{index}")),
        )
    }
}

/// Where [`Registry::bury`] put a box's record and data.
#[derive(Debug)]
pub struct Tombs {
    record: PathBuf,
    data: PathBuf,
}

/// An exclusive lock on one box record, released on drop.
#[derive(Debug)]
pub struct BoxLock {
    _lock: Flock<fs::File>,
}

impl Registry {
    /// The registry under `roots`.
    pub fn new(roots: Roots) -> Self {
        Registry { roots }
    }

    /// The roots it lives under.
    pub fn roots(&self) -> &Roots {
        &self.roots
    }

    /// Record a new box. Fails with [`RuntimeError::NameInUse`] if the name exists.
    pub fn create(&self, spec: &BoxSpec) -> Result<BoxRecord> {
        let boxes = self.roots.boxes();
        mkdir_p(&boxes)?;
        let final_dir = boxes.join(&spec.name);
        if final_dir.exists() {
            return Err(RuntimeError::NameInUse(spec.name.clone()));
        }
        let id = new_id();
        let tmp = boxes.join(format!(".new-{id}"));
        mkdir_p(&tmp)?;
        let state = BoxState::creating(id.clone());
        let built = (|| {
            write_json(&tmp.join("spec.json"), spec)?;
            write_json(&tmp.join("state.json"), &state)?;
            fs::File::create(tmp.join("lock"))
                .map_err(RuntimeError::io("create", tmp.join("lock")))?;
            nix::fcntl::renameat2(
                None,
                &tmp,
                None,
                &final_dir,
                nix::fcntl::RenameFlags::RENAME_NOREPLACE,
            )
            .map_err(|e| {
                if e == nix::errno::Errno::EEXIST {
                    RuntimeError::NameInUse(spec.name.clone())
                } else {
                    RuntimeError::sys(format!(
                        "rename {} to {}",
                        tmp.display(),
                        final_dir.display()
                    ))(e)
                }
            })
        })();
        if let Err(e) = built {
            // `gc` removes a half-made record (an orphan) that this leaves.
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
        let lib_dir = self.roots.box_lib(&id);
        if let Err(e) = mkdir_p(&lib_dir) {
            // As above: the mkdir's error is the one to report.
            let _ = fs::remove_dir_all(&final_dir);
            return Err(e);
        }
        Ok(BoxRecord {
            spec: spec.clone(),
            state,
            run_dir: final_dir,
            lib_dir,
        })
    }

    /// Rename box `old` to `new`: one rename of its record directory, atomic
    /// (of two processes renaming the same box, one wins). A record's name is
    /// its directory's (see [`Registry::load`]), so nothing else is rewritten.
    /// The box's id, data and processes are unchanged.
    pub fn rename(&self, old: &str, new: &str) -> Result<()> {
        crate::spec::validate_name(new)?;
        let boxes = self.roots.boxes();
        let (from, to) = (boxes.join(old), boxes.join(new));
        nix::fcntl::renameat2(
            None,
            &from,
            None,
            &to,
            nix::fcntl::RenameFlags::RENAME_NOREPLACE,
        )
        .map_err(|e| match e {
            nix::errno::Errno::EEXIST => RuntimeError::NameInUse(new.to_string()),
            nix::errno::Errno::ENOENT => RuntimeError::NoSuchBox(old.to_string()),
            e => RuntimeError::sys(format!("rename {} to {}", from.display(), to.display()))(e),
        })
    }

    /// The record of the box with id `id`, whatever its name is now.
    pub fn load_by_id(&self, id: &str) -> Result<BoxRecord> {
        self.list()?
            .into_iter()
            .find(|r| r.state.id == id)
            .ok_or_else(|| RuntimeError::NoSuchBox(format!("id {id}")))
    }

    /// Load the record of `name`.
    pub fn load(&self, name: &str) -> Result<BoxRecord> {
        if crate::spec::validate_name(name).is_err() {
            return Err(RuntimeError::NoSuchBox(name.to_string()));
        }
        let dir = self.roots.box_run(name);
        let mut spec: BoxSpec = match read_json(&dir.join("spec.json")) {
            Ok(s) => s,
            Err(RuntimeError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                return Err(RuntimeError::NoSuchBox(name.to_string()))
            }
            Err(e) => return Err(e),
        };
        let state: BoxState = match read_json(&dir.join("state.json")) {
            Ok(s) => s,
            Err(RuntimeError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                return Err(RuntimeError::NoSuchBox(name.to_string()))
            }
            Err(e) => return Err(e),
        };
        let lib_dir = self.roots.box_lib(&state.id);
        // The directory's name is the box's name (a rename is one atomic
        // directory rename); a clone's hostname is its name.
        if spec.name != name {
            if spec.clone_of.is_some() {
                spec.hostname = name.to_string();
            }
            spec.name = name.to_string();
        }
        Ok(BoxRecord {
            spec,
            state,
            run_dir: dir,
            lib_dir,
        })
    }

    /// All boxes, sorted by creation time. Records that vanish while listing are skipped.
    pub fn list(&self) -> Result<Vec<BoxRecord>> {
        let boxes = self.roots.boxes();
        let entries = match fs::read_dir(&boxes) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(RuntimeError::io("list", &boxes)(e)),
        };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if name.starts_with('.') {
                continue;
            }
            match self.load(&name) {
                Ok(r) => out.push(r),
                Err(RuntimeError::NoSuchBox(_)) => continue,
                Err(e) => return Err(e),
            }
        }
        out.sort_by(|a, b| a.state.created_at.total_cmp(&b.state.created_at));
        Ok(out)
    }

    /// The names of the records that start with `prefix` (directory names
    /// only: no record is read), sorted.
    pub fn names_prefixed(&self, prefix: &str) -> Result<Vec<String>> {
        let boxes = self.roots.boxes();
        let entries = match fs::read_dir(&boxes) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(RuntimeError::io("list", &boxes)(e)),
        };
        let mut names: Vec<String> = entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .filter(|n| n.starts_with(prefix))
            .collect();
        names.sort();
        Ok(names)
    }

    /// The records whose names start with `prefix`, found by their directory
    /// names alone (no other record is read).
    pub fn list_prefixed(&self, prefix: &str) -> Result<Vec<BoxRecord>> {
        let mut out = Vec::new();
        for name in self.names_prefixed(prefix)? {
            match self.load(&name) {
                Ok(r) => out.push(r),
                Err(RuntimeError::NoSuchBox(_)) => continue,
                Err(e) => return Err(e),
            }
        }
        out.sort_by(|a, b| a.state.created_at.total_cmp(&b.state.created_at));
        Ok(out)
    }

    /// Take the exclusive lock of `name`'s record.
    pub fn lock(&self, name: &str) -> Result<BoxLock> {
        let path = self.roots.box_run(name).join("lock");
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    RuntimeError::NoSuchBox(name.to_string())
                } else {
                    RuntimeError::io("open", &path)(e)
                }
            })?;
        let lock = Flock::lock(file, FlockArg::LockExclusive)
            .map_err(|(_, e)| RuntimeError::sys(format!("flock {}", path.display()))(e))?;
        Ok(BoxLock { _lock: lock })
    }

    /// Change `name`'s state under its lock and return the new state.
    pub fn update(&self, name: &str, change: impl FnOnce(&mut BoxState)) -> Result<BoxState> {
        let _lock = self.lock(name)?;
        let path = self.roots.box_run(name).join("state.json");
        let mut state: BoxState = read_json(&path)?;
        change(&mut state);
        write_json(&path, &state)?;
        Ok(state)
    }

    /// Delete the record and data of a box (its processes and cgroup must be gone).
    pub fn remove(&self, record: &BoxRecord) -> Result<()> {
        crate::disk::release(&record.lib_dir)?;
        remove_tree(&record.lib_dir)?;
        // Rename first so the name is free at once and a half-deleted record is never listed.
        let tomb = self.roots.boxes().join(format!(".rm-{}", record.state.id));
        match fs::rename(&record.run_dir, &tomb) {
            Ok(()) => fs::remove_dir_all(&tomb).map_err(RuntimeError::io("remove", &tomb)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(RuntimeError::io("rename", &record.run_dir)(e)),
        }
    }

    /// The first half of [`Registry::remove`], for a caller that answers
    /// before it removes: the record and the data directory are renamed out
    /// of the way (the name is free at once, nothing of the box is listed),
    /// to the tombs `.rm-ID` that [`Registry::remove_buried`] removes. Until
    /// then (and for 5 s: see [`Registry::young_tomb_ids`]) `gc` takes the
    /// box's id for a live one and leaves the tombs alone; older ones, whose
    /// remover died, it removes.
    pub fn bury(&self, record: &BoxRecord) -> Result<Tombs> {
        crate::disk::release(&record.lib_dir)?;
        let tomb = self.roots.boxes().join(format!(".rm-{}", record.state.id));
        fs::rename(&record.run_dir, &tomb).map_err(RuntimeError::io("rename", &record.run_dir))?;
        let data = self
            .roots
            .lib
            .join("boxes")
            .join(format!(".rm-{}", record.state.id));
        match fs::rename(&record.lib_dir, &data) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(RuntimeError::io("rename", &record.lib_dir)(e)),
        }
        Ok(Tombs { record: tomb, data })
    }

    /// The second half of [`Registry::remove`] after [`Registry::bury`].
    pub fn remove_buried(&self, tombs: &Tombs) -> Result<()> {
        remove_tree(&tombs.data)?;
        remove_tree(&tombs.record)
    }

    /// The ids of boxes being removed right now: record directories renamed
    /// to `.rm-ID` less than 5 s ago (an older one's remover died: `gc`
    /// removes it).
    pub fn young_tomb_ids(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Ok(entries) = fs::read_dir(self.roots.boxes()) {
            for e in entries.flatten() {
                let n = e.file_name().to_string_lossy().to_string();
                let Some(id) = n.strip_prefix(".rm-") else {
                    continue;
                };
                let young = age(&e.path()).is_some_and(|a| a < std::time::Duration::from_secs(5));
                if young {
                    out.push(id.to_string());
                }
            }
        }
        out
    }

    /// Leftovers not belonging to any record: half-created or half-removed record
    /// directories and data directories of unknown ids. Used by garbage collection.
    pub fn orphans(&self, live_ids: &[String]) -> Vec<PathBuf> {
        let mut out = Vec::new();
        if let Ok(entries) = fs::read_dir(self.roots.boxes()) {
            for e in entries.flatten() {
                let n = e.file_name().to_string_lossy().to_string();
                if n.starts_with(".rm-")
                    || (n.starts_with(".new-")
                        && !live_ids.iter().any(|id| n.ends_with(id.as_str())))
                {
                    out.push(e.path());
                }
            }
        }
        if let Ok(entries) = fs::read_dir(self.roots.lib.join("boxes")) {
            for e in entries.flatten() {
                let n = e.file_name().to_string_lossy().to_string();
                if !live_ids.contains(&n) {
                    out.push(e.path());
                }
            }
        }
        out
    }
}

/// How long ago `path` was made or renamed (its inode's change time: a rename
/// sets it, and a directory's contents changing do not).
pub fn age(path: &Path) -> Option<std::time::Duration> {
    use std::os::unix::fs::MetadataExt;
    let m = fs::symlink_metadata(path).ok()?;
    let changed = std::time::UNIX_EPOCH
        + std::time::Duration::new(m.ctime().max(0) as u64, m.ctime_nsec().max(0) as u32);
    changed.elapsed().ok()
}

/// A new random box id: 12 lowercase hex digits.
pub fn new_id() -> String {
    let mut b = [0u8; 6];
    getrandom::getrandom(&mut b).expect("the kernel's random source is available");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A generated box name.
pub fn generated_name() -> String {
    format!("box-{}", &new_id()[..8])
}

/// Remove a directory tree that may hold directories without permissions
/// (overlayfs leaves `work/work` with mode 000, which a caller without
/// CAP_DAC_OVERRIDE cannot list): on EACCES, open up the modes and retry. A
/// process that is ending (a monitor writing its last log line) may create a
/// file in the tree while it is removed (ENOTEMPTY): removed again, a few
/// times. A tree that does not exist is fine.
pub fn remove_tree(path: &Path) -> Result<()> {
    let mut opened_up = false;
    let mut attempts = 0;
    loop {
        attempts += 1;
        match fs::remove_dir_all(path) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied && !opened_up => {
                open_up(path);
                opened_up = true;
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) && attempts < 5 => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(e) => return Err(RuntimeError::io("remove", path)(e)),
        }
    }
}

/// Give the owner full access to every directory below `dir` (best effort).
fn open_up(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(meta) = fs::symlink_metadata(dir) else {
        return;
    };
    if !meta.is_dir() {
        return;
    }
    // Best effort: a directory still closed makes the removal fail, which
    // reports it.
    let _ = fs::set_permissions(dir, fs::Permissions::from_mode(0o700));
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            open_up(&e.path());
        }
    }
}

fn mkdir_p(p: &Path) -> Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o711)
        .create(p)
        .map_err(RuntimeError::io("mkdir", p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::tests_support::sample;

    #[test]
    fn create_load_list_remove() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::new(Roots::under(dir.path()));
        let rec = reg.create(&sample("a")).unwrap();
        assert!(matches!(
            reg.create(&sample("a")),
            Err(RuntimeError::NameInUse(_))
        ));
        reg.create(&sample("b")).unwrap();
        let names: Vec<_> = reg
            .list()
            .unwrap()
            .iter()
            .map(|r| r.name().to_string())
            .collect();
        assert_eq!(names, ["a", "b"]);
        reg.update("a", |s| s.exit_code = Some(3)).unwrap();
        assert_eq!(reg.load("a").unwrap().state.exit_code, Some(3));
        reg.remove(&rec).unwrap();
        assert!(matches!(reg.load("a"), Err(RuntimeError::NoSuchBox(_))));
        assert!(!rec.lib_dir().exists());
        assert_eq!(reg.list().unwrap().len(), 1);
    }

    #[test]
    fn concurrent_creates_of_one_name_have_one_winner() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::new(Roots::under(dir.path()));
        let wins: usize = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8)
                .map(|_| s.spawn(|| reg.create(&sample("same")).is_ok()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap() as usize).sum()
        });
        assert_eq!(wins, 1);
        let ids: Vec<String> = reg
            .list()
            .unwrap()
            .iter()
            .map(|r| r.state.id.clone())
            .collect();
        // the losers' data directories were never made, and no temporary record is left
        assert_eq!(
            fs::read_dir(dir.path().join("lib/boxes")).unwrap().count(),
            1
        );
        assert!(reg.orphans(&ids).is_empty());
    }

    #[test]
    fn remove_tree_handles_directories_without_permissions() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let locked = dir.path().join("t/work/work");
        fs::create_dir_all(locked.join("inner")).unwrap();
        fs::set_permissions(&locked, fs::Permissions::from_mode(0o000)).unwrap();
        remove_tree(&dir.path().join("t")).unwrap();
        assert!(!dir.path().join("t").exists());
        remove_tree(&dir.path().join("t")).unwrap();
    }

    #[test]
    fn unknown_and_invalid_names_are_no_such_box() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::new(Roots::under(dir.path()));
        assert!(matches!(reg.load("nope"), Err(RuntimeError::NoSuchBox(_))));
        assert!(matches!(
            reg.load("../etc"),
            Err(RuntimeError::NoSuchBox(_))
        ));
    }
}
