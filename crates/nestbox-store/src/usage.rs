//! `store df`: logical bytes (what images and box layers hold, counting every file
//! as if it had its own copy) against physical bytes (allocated blocks of every
//! distinct inode in the store and the layers, each counted once however many
//! names it has), and their ratio.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::Result;
use crate::store::Store;
use crate::walk::walk;

/// Disk usage figures.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Usage {
    /// Named images.
    pub images: u64,
    /// Regular files over all images.
    pub image_files: u64,
    /// Their content bytes.
    pub image_logical_bytes: u64,
    /// Box layers looked at.
    pub layers: u64,
    /// Regular files in box layers.
    pub layer_files: u64,
    /// Their content bytes.
    pub layer_logical_bytes: u64,
    /// Images plus layers.
    pub logical_bytes: u64,
    /// Inodes in the object directory.
    pub objects: u64,
    /// Allocated bytes of the store (objects, manifests, trees), each inode once.
    pub store_physical_bytes: u64,
    /// Allocated bytes of the layers not already counted in the store.
    pub layer_physical_bytes: u64,
    /// Store plus layers.
    pub physical_bytes: u64,
    /// logical / physical.
    pub sharing_ratio: f64,
}

impl Store {
    /// Usage of the store plus the box layer directories `layers`.
    pub fn usage(&self, layers: &[PathBuf]) -> Result<Usage> {
        let mut u = Usage::default();
        for image in self.images()? {
            u.images += 1;
            u.image_files += image.files;
            u.image_logical_bytes += image.bytes;
        }
        let mut seen = HashSet::new();
        let mut count = |root: &Path, files: Option<(&mut u64, &mut u64)>| -> Result<u64> {
            let mut physical = 0;
            let mut files = files;
            if !root.exists() {
                return Ok(0);
            }
            for e in walk(root, true)? {
                if let Some((n, bytes)) = files.as_mut() {
                    if e.md.is_file() {
                        **n += 1;
                        **bytes += e.md.len();
                    }
                }
                if seen.insert((e.md.dev(), e.md.ino())) {
                    physical += e.md.blocks() * 512;
                }
            }
            Ok(physical)
        };
        let objects_dir = self.objects_dir();
        let mut objects = 0u64;
        let mut obj_bytes = 0u64;
        u.store_physical_bytes += count(&objects_dir, Some((&mut objects, &mut obj_bytes)))?;
        u.objects = objects;
        u.store_physical_bytes += count(&self.trees_dir(), None)?;
        for l in layers {
            u.layers += 1;
            let (mut n, mut b) = (0, 0);
            u.layer_physical_bytes += count(l, Some((&mut n, &mut b)))?;
            u.layer_files += n;
            u.layer_logical_bytes += b;
        }
        u.logical_bytes = u.image_logical_bytes + u.layer_logical_bytes;
        u.physical_bytes = u.store_physical_bytes + u.layer_physical_bytes;
        u.sharing_ratio = if u.physical_bytes == 0 {
            0.0
        } else {
            u.logical_bytes as f64 / u.physical_bytes as f64
        };
        Ok(u)
    }
}
