//! Whole-tree copies of runtime-owned directories (`cp -a`): a checkpoint's
//! root layers, a nest box's state directory for its clone.
//!
//! A shell-out, written down in `docs/architecture.md` ("Exceptions to …"): a
//! faithful copy (owners, modes, times, extended attributes, hard links,
//! special files, sparse files) is what coreutils' `cp -a` is made for, and
//! these copies are off every start path.

use std::path::Path;

use crate::{Result, RuntimeError};

/// `cp -a FROM TO`: `TO` (which must not exist) becomes a copy of directory
/// `FROM`. The error names both and carries `cp`'s own message.
pub fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    let out = std::process::Command::new("cp")
        .arg("-a")
        .arg("--")
        .arg(from)
        .arg(to)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(RuntimeError::io("running cp -a for", from))?;
    if !out.status.success() {
        return Err(RuntimeError::Failed(format!(
            "copying {} to {}: cp: {}",
            from.display(),
            to.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_tree_is_copied_with_its_modes_and_a_bad_source_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let from = tmp.path().join("from");
        std::fs::create_dir_all(from.join("a/b")).unwrap();
        std::fs::write(from.join("a/b/f"), "x").unwrap();
        std::fs::set_permissions(from.join("a/b/f"), std::fs::Permissions::from_mode(0o640))
            .unwrap();
        let to = tmp.path().join("to");
        copy_tree(&from, &to).unwrap();
        assert_eq!(std::fs::read_to_string(to.join("a/b/f")).unwrap(), "x");
        let mode = std::fs::metadata(to.join("a/b/f"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o640);
        let err = copy_tree(&tmp.path().join("missing"), &tmp.path().join("x")).unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
    }
}
