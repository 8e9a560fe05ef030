//! Small filesystem helpers for cgroup control files and directories.
//!
//! All helpers turn `io::Error`s into [`CgroupError::Io`] with the path, the
//! operation and (for writes) the value.
//!
//! Control files are opened for writing with `O_WRONLY|O_TRUNC` and never
//! created: a missing control file is an error, as it is on the kernel's
//! cgroupfs. To let unit tests run on a *fake* cgroup tree (plain directories
//! and files in a temp dir), directory creation and removal behave like the
//! kernel when the directory is not on a cgroup filesystem:
//!
//! * [`make_dir`] seeds the new directory with empty copies of the parent's
//!   regular files, the way the kernel populates a new cgroup with control
//!   files;
//! * [`remove_dir`] removes those plain files (not recursively), which
//!   cgroupfs does by itself.
//!
//! On a real cgroup filesystem (checked with `statfs`) only `mkdir`/`rmdir`
//! are used.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use crate::error::{CgroupError, Op};

/// Reads a control file.
pub(crate) fn read(path: &Path) -> Result<String, CgroupError> {
    fs::read_to_string(path).map_err(|e| CgroupError::io(Op::Read, path, e))
}

/// Reads a control file; a missing file (or directory) gives `None`.
pub(crate) fn read_opt(path: &Path) -> Result<Option<String>, CgroupError> {
    match fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(CgroupError::io(Op::Read, path, e)),
    }
}

/// [`read_opt`] of a file of a cgroup that may be removed meanwhile: a
/// cgroup removed between the open and the read fails it with `ENODEV`,
/// which is `None` too (the cgroup is gone).
pub(crate) fn read_if_alive(path: &Path) -> Result<Option<String>, CgroupError> {
    match fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) if e.raw_os_error() == Some(nix::errno::Errno::ENODEV as i32) => Ok(None),
        Err(e) => Err(CgroupError::io(Op::Read, path, e)),
    }
}

/// Writes `value` to an existing control file in one `write(2)`.
pub(crate) fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    write_with_hint(path, value, None)
}

/// Like [`write`], attaching `hint` to the error.
pub(crate) fn write_with_hint(
    path: &Path,
    value: &str,
    hint: Option<&str>,
) -> Result<(), CgroupError> {
    let res = fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .and_then(|mut f| f.write_all(value.as_bytes()));
    res.map_err(|err| CgroupError::Io {
        op: Op::Write,
        path: path.to_path_buf(),
        value: Some(value.to_string()),
        err,
        hint: hint.map(str::to_string),
    })
}

/// Writes the hugetlb limit of page size `size` (the kernel's name, `2MB`)
/// into cgroup `dir`: `hugetlb.<size>.<suffix>` (`limit_in_bytes` on v1,
/// `max` on v2) and, where the kernel has it (Linux 5.7), the limit on
/// reservations `hugetlb.<size>.rsvd.<suffix>`, as runc does. A size the
/// kernel has no file for is refused, naming the sizes it has.
pub(crate) fn write_hugetlb(
    dir: &Path,
    size: &str,
    limit: u64,
    suffix: &str,
) -> Result<(), CgroupError> {
    let file = dir.join(format!("hugetlb.{size}.{suffix}"));
    if !file.exists() {
        let mut sizes: Vec<String> = fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let size = name
                    .strip_prefix("hugetlb.")?
                    .strip_suffix(&format!(".{suffix}"))?;
                (!size.contains('.')).then(|| size.to_string())
            })
            .collect();
        sizes.sort();
        return Err(CgroupError::Unsupported {
            option: "hugepage_limits",
            reason: format!(
                "the kernel has no {size} huge pages ({} is missing; it has: {})",
                file.display(),
                if sizes.is_empty() {
                    "none".to_string()
                } else {
                    sizes.join(", ")
                }
            ),
        });
    }
    write(&file, &limit.to_string())?;
    let rsvd = dir.join(format!("hugetlb.{size}.rsvd.{suffix}"));
    if rsvd.exists() {
        write(&rsvd, &limit.to_string())?;
    }
    Ok(())
}

/// True when `path` is on a cgroup v1 or v2 filesystem.
pub(crate) fn is_cgroupfs(path: &Path) -> bool {
    use nix::sys::statfs::{statfs, CGROUP2_SUPER_MAGIC, CGROUP_SUPER_MAGIC};
    match statfs(path) {
        Ok(st) => {
            let t = st.filesystem_type();
            t == CGROUP_SUPER_MAGIC || t == CGROUP2_SUPER_MAGIC
        }
        Err(_) => false,
    }
}

/// Creates the cgroup directory `dir`. An existing directory gives
/// [`CgroupError::AlreadyExists`]. On a fake (non-cgroup) tree the new
/// directory is seeded with empty copies of the parent's regular files.
pub(crate) fn make_dir(dir: &Path) -> Result<(), CgroupError> {
    match fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            return Err(CgroupError::AlreadyExists {
                path: dir.to_path_buf(),
            })
        }
        Err(e) => return Err(CgroupError::io(Op::Mkdir, dir, e)),
    }
    let Some(parent) = dir.parent() else {
        return Ok(());
    };
    if is_cgroupfs(parent) {
        return Ok(());
    }
    let seed = || -> Result<(), CgroupError> {
        for entry in fs::read_dir(parent).map_err(|e| CgroupError::io(Op::ReadDir, parent, e))? {
            let entry = entry.map_err(|e| CgroupError::io(Op::ReadDir, parent, e))?;
            let is_file = entry.file_type().map(|t| t.is_file()).unwrap_or(false);
            if is_file {
                let target = dir.join(entry.file_name());
                fs::File::create(&target).map_err(|e| CgroupError::io(Op::Write, &target, e))?;
            }
        }
        Ok(())
    };
    if let Err(e) = seed() {
        // Only fake cgroupfs trees of unit tests are seeded: the seeding error
        // is what matters; the temporary tree goes with the test's tempdir.
        let _ = fs::remove_dir_all(dir);
        return Err(e);
    }
    Ok(())
}

/// How long [`remove_dir`] retries `EBUSY`.
const RMDIR_RETRY: Duration = Duration::from_millis(1000);

/// Removes the cgroup directory `dir` and any child cgroups below it.
/// A missing directory is fine. `EBUSY` (processes still exiting) is retried
/// for about a second.
pub(crate) fn remove_dir(dir: &Path) -> Result<(), CgroupError> {
    if !is_cgroupfs(dir) {
        return remove_plain_dir(dir);
    }
    // Child cgroups first (depth first). Control files cannot be unlinked
    // and need not be: rmdir of a cgroup removes them.
    match fs::read_dir(dir) {
        Ok(entries) => {
            for entry in entries.flatten() {
                if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    remove_dir(&entry.path())?;
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(CgroupError::io(Op::ReadDir, dir, e)),
    }
    let start = Instant::now();
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && start.elapsed() < RMDIR_RETRY => {
                thread::sleep(Duration::from_millis(10));
            }
            Err(e) => {
                let hint = (e.raw_os_error() == Some(libc::EBUSY))
                    .then(|| "the cgroup still has processes or child cgroups".to_string());
                return Err(CgroupError::Io {
                    op: Op::Rmdir,
                    path: dir.to_path_buf(),
                    value: None,
                    err: e,
                    hint,
                });
            }
        }
    }
}

/// Removes a directory of a fake (non-cgroup) tree: its plain files and its
/// child directories (child cgroups, depth first), then the directory.
fn remove_plain_dir(dir: &Path) -> Result<(), CgroupError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(CgroupError::io(Op::ReadDir, dir, e)),
    };
    for entry in entries.flatten() {
        let kind = entry.file_type().ok();
        if kind.is_some_and(|t| t.is_file()) {
            // Files only exist in fake trees (cgroupfs files cannot be
            // removed, and need not be); one left makes remove_dir below fail,
            // which reports it.
            let _ = fs::remove_file(entry.path());
        } else if kind.is_some_and(|t| t.is_dir()) {
            // A child cgroup (a delegated box's leaf or its own boxes), as
            // the kernel's tree is removed: depth first.
            remove_plain_dir(&entry.path())?;
        }
    }
    match fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(CgroupError::io(Op::Rmdir, dir, e)),
    }
}

/// Whether the calling process runs in a user namespace other than the
/// initial one (its `/proc/self/uid_map` maps anything but every id to
/// itself): inside a box, the host's root privileges over cgroups (the v1
/// devices controller's rules) are out of reach.
pub(crate) fn in_user_namespace() -> bool {
    match fs::read_to_string("/proc/self/uid_map") {
        Ok(text) => {
            let fields: Vec<&str> = text.split_whitespace().collect();
            fields != ["0", "0", "4294967295"]
        }
        Err(_) => false,
    }
}

/// Calls `check` every `step` until it returns `true` or `timeout` passes.
/// Returns `Ok(true)` on success, `Ok(false)` on timeout.
pub(crate) fn poll_until(
    timeout: Duration,
    step: Duration,
    mut check: impl FnMut(u32) -> Result<bool, CgroupError>,
) -> Result<bool, CgroupError> {
    let start = Instant::now();
    let mut round = 0u32;
    loop {
        if check(round)? {
            return Ok(true);
        }
        if start.elapsed() >= timeout {
            return Ok(false);
        }
        thread::sleep(step);
        round = round.wrapping_add(1);
    }
}

/// Joins a cgroup path relative to a hierarchy (`/a/b` or `a/b`) onto `base`,
/// without adding a trailing separator for `/`.
pub(crate) fn join_rel(base: &Path, rel: &str) -> PathBuf {
    let rel = rel.trim_start_matches('/');
    if rel.is_empty() {
        base.to_path_buf()
    } else {
        base.join(rel)
    }
}

/// The first of the files `names` that `dir` has (controllers name a file
/// differently by kernel and scheduler: `io.weight` or `io.bfq.weight`).
pub(crate) fn first_present(dir: &Path, names: &[&str]) -> Option<PathBuf> {
    names.iter().map(|n| dir.join(n)).find(|f| f.exists())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_mkdir_seeds_and_remove_cleans() {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("pids.max"), "max").unwrap();
        fs::create_dir(tmp.path().join("other")).unwrap();
        let d = tmp.path().join("child");
        make_dir(&d).unwrap();
        assert_eq!(fs::read_to_string(d.join("pids.max")).unwrap(), "");
        assert!(!d.join("other").exists());
        assert!(matches!(
            make_dir(&d),
            Err(CgroupError::AlreadyExists { .. })
        ));
        write(&d.join("pids.max"), "10").unwrap();
        write(&d.join("pids.max"), "7").unwrap();
        assert_eq!(read(&d.join("pids.max")).unwrap(), "7");
        let err = write(&d.join("nope"), "1").unwrap_err();
        assert!(err.is_not_found());
        // A file of a cgroup removed while it was open reads ENODEV: gone too.
        let removed = CgroupError::io(
            Op::Read,
            d.join("freezer.state"),
            io::Error::from_raw_os_error(libc::ENODEV),
        );
        assert!(removed.is_not_found(), "{removed}");
        let other = CgroupError::io(Op::Read, &d, io::Error::from_raw_os_error(libc::EACCES));
        assert!(!other.is_not_found());
        remove_dir(&d).unwrap();
        assert!(!d.exists());
        remove_dir(&d).unwrap();
    }

    #[test]
    fn join_rel_root() {
        assert_eq!(join_rel(Path::new("/m"), "/"), PathBuf::from("/m"));
        assert_eq!(join_rel(Path::new("/m"), "/a/b"), PathBuf::from("/m/a/b"));
    }
}
