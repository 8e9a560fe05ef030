//! Reclaiming space: removing an image name (and its lower tree), and `store gc`,
//! which deletes what nothing references — objects no image's manifest names and
//! no other file links to (a link count of 1: box layers merged by `dedup` keep
//! their objects alive), trees of removed images, and staging areas of dead imports.

use std::collections::HashSet;
use std::fs;
use std::os::unix::fs::MetadataExt;

use serde::Serialize;

use crate::error::{Result, StoreError};
use crate::hash::Digest;
use crate::meta::Meta;
use crate::store::Store;
use crate::tree::remove_tree;
use crate::txn::clean_stale;
use crate::verify::parse_object_name;
use crate::walk::walk;

/// What `gc` removed.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct GcReport {
    /// Objects deleted.
    pub objects_removed: u64,
    /// Their allocated bytes.
    pub bytes_freed: u64,
    /// Lower trees deleted.
    pub trees_removed: u64,
    /// Staging directories of dead transactions deleted.
    pub staging_removed: u64,
}

impl Store {
    /// Remove the image `name`: its name at once, its lower tree if no other name
    /// has the same id; objects stay until `gc`. The caller checks that no box
    /// uses it.
    pub fn remove_image(&self, name: &str) -> Result<()> {
        let _lock = self.lock_shared()?;
        let image = self.image(name)?;
        self.remove_ref(name)?;
        if !self.images()?.iter().any(|i| i.id == image.id) {
            remove_tree(&self.tree_path(&image.id))?;
        }
        Ok(())
    }

    /// Delete everything unreferenced.
    pub fn gc(&self) -> Result<GcReport> {
        self.gc_keeping(&|| Ok(Vec::new()))
    }

    /// [`Store::gc`], also keeping the inodes `keep` lists (what references
    /// the store from outside it, such as box layer snapshots). `keep` is
    /// called once the exclusive lock is held: whatever is written under the
    /// shared lock (a snapshot's objects and then its record) is either
    /// complete and listed, or not referenced yet.
    pub fn gc_keeping(&self, keep: &dyn Fn() -> Result<Vec<(Digest, String)>>) -> Result<GcReport> {
        let _lock = self.lock_exclusive()?;
        let mut report = GcReport {
            staging_removed: clean_stale(self, true),
            ..GcReport::default()
        };
        let images = self.images()?;
        let live_ids: HashSet<Digest> = images.iter().map(|i| i.id).collect();
        let internal = Meta::internal().key();
        let mut live: HashSet<(Digest, String)> = keep()?.into_iter().collect();
        for image in &images {
            live.insert((image.id, internal.clone()));
            for inode in self.manifest(&image.id)?.inodes() {
                live.insert(inode);
            }
        }
        let trees = self.trees_dir();
        if let Ok(entries) = fs::read_dir(&trees) {
            for e in entries.flatten() {
                let n = e.file_name().to_string_lossy().to_string();
                let keep = Digest::parse(&n).is_some_and(|d| live_ids.contains(&d));
                if !keep {
                    remove_tree(&e.path())?;
                    report.trees_removed += 1;
                }
            }
        }
        for e in walk(&self.objects_dir(), true)? {
            if !e.md.is_file() {
                continue;
            }
            let name = e.rel.rsplit('/').next().unwrap_or(&e.rel);
            let Some(inode) = parse_object_name(name) else {
                continue;
            };
            if live.contains(&inode) || e.md.nlink() > 1 {
                continue;
            }
            fs::remove_file(&e.path).map_err(StoreError::io("unlink", &e.path))?;
            report.objects_removed += 1;
            report.bytes_freed += e.md.blocks() * 512;
        }
        self.sync()?;
        Ok(report)
    }
}
