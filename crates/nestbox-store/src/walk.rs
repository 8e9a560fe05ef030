//! Walking a directory tree in sorted pre-order (parents before children), with
//! `lstat` metadata and names checked to be UTF-8; optionally staying on one
//! filesystem (mount points below the root are listed but not entered).

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::{Result, StoreError};
use crate::manifest::join;

/// One path found by [`walk`].
#[derive(Debug, Clone)]
pub struct WalkEntry {
    /// Path relative to the root ("" for the root).
    pub rel: String,
    /// Full path.
    pub path: PathBuf,
    /// `lstat` of it.
    pub md: fs::Metadata,
}

/// Every path under `root`, sorted, parents first. With `one_fs`, directories on
/// another filesystem are listed but not entered.
pub fn walk(root: &Path, one_fs: bool) -> Result<Vec<WalkEntry>> {
    let md = fs::symlink_metadata(root).map_err(StoreError::io("stat", root))?;
    let dev = md.dev();
    let mut out = vec![WalkEntry {
        rel: String::new(),
        path: root.to_path_buf(),
        md,
    }];
    let mut i = 0;
    // Depth-first pre-order: children are spliced in right after their directory.
    while i < out.len() {
        let e = &out[i];
        if e.md.is_dir() && (!one_fs || e.md.dev() == dev) {
            let (rel, path) = (e.rel.clone(), e.path.clone());
            let mut kids = Vec::new();
            for d in fs::read_dir(&path).map_err(StoreError::io("read directory", &path))? {
                let d = d.map_err(StoreError::io("read directory", &path))?;
                let name = d.file_name();
                let name = name.to_str().ok_or_else(|| {
                    StoreError::refused(
                        root,
                        join(&rel, &name.to_string_lossy()),
                        "name is not UTF-8",
                    )
                })?;
                let p = d.path();
                let md = fs::symlink_metadata(&p).map_err(StoreError::io("stat", &p))?;
                kids.push(WalkEntry {
                    rel: join(&rel, name),
                    path: p,
                    md,
                });
            }
            kids.sort_by(|a, b| a.rel.cmp(&b.rel));
            out.splice(i + 1..i + 1, kids);
        }
        i += 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parents_come_first() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join("a/b")).unwrap();
        fs::write(d.path().join("a/b/f"), b"x").unwrap();
        fs::write(d.path().join("a-z"), b"y").unwrap();
        let rels: Vec<String> = walk(d.path(), true)
            .unwrap()
            .into_iter()
            .map(|e| e.rel)
            .collect();
        assert_eq!(rels, vec!["", "a", "a/b", "a/b/f", "a-z"]);
    }
}
