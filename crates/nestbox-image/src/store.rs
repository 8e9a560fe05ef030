//! Images imported into the content-addressed store (`nestbox image import`).
//!
//! The box root's single lower layer is the image's tree in the store: real
//! directories whose regular files are hardlinks to the store's objects, built once
//! per image and cached. Every box of the image therefore opens the same inodes
//! and shares one page-cache copy of each file; the box's private overlay upper
//! layer takes every write.

use std::path::{Path, PathBuf};

use nestbox_store::{Digest, Store};

use crate::{Image, ImageError, Layer, RootView};

/// Directory of the store under the images directory (`Roots::images()`).
pub fn store_dir(images_dir: &Path) -> PathBuf {
    images_dir.join("store")
}

/// An image held in the store.
#[derive(Debug, Clone)]
pub struct StoreImage {
    store: Store,
    name: String,
    id: Digest,
}

impl StoreImage {
    /// Look `name` up in the store under `images_dir`.
    pub fn open(name: &str, images_dir: &Path) -> Result<Self, ImageError> {
        let Some(store) = Store::open_existing(&store_dir(images_dir)) else {
            return Err(ImageError::Unknown(name.to_string()));
        };
        match store.image(name) {
            Ok(r) => Ok(StoreImage {
                store,
                name: name.to_string(),
                id: r.id,
            }),
            Err(nestbox_store::StoreError::NoSuchImage(_)) => {
                Err(ImageError::Unknown(name.to_string()))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The image id (digest of its manifest).
    pub fn id(&self) -> Digest {
        self.id
    }
}

impl Image for StoreImage {
    fn name(&self) -> &str {
        &self.name
    }

    fn root_view(&self, owner: Option<(u32, u32)>) -> Result<RootView, ImageError> {
        if owner.is_some() {
            // The tree's inodes carry the image's own owners (mostly host uid 0),
            // which a user namespace does not map: the box could not copy up or
            // own anything. Shifting owners would need per-box copies of every
            // inode (no sharing) or idmapped mounts.
            return Err(ImageError::Unsupported {
                image: self.name.clone(),
                why: "store images cannot be used by boxes with a user namespace yet (run as root without --userns)".into(),
            });
        }
        let tree = nestbox_store::ensure_tree(&self.store, &self.id)?;
        Ok(RootView {
            layers: vec![Layer {
                target: PathBuf::from("/"),
                lowers: vec![tree],
            }],
            read_only: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::open_image;

    #[test]
    fn store_images_resolve_to_their_cached_tree() {
        let images = tempfile::tempdir().unwrap();
        let src = tempfile::tempdir().unwrap();
        std::fs::create_dir(src.path().join("etc")).unwrap();
        std::fs::write(src.path().join("etc/hello"), b"hi\n").unwrap();
        let store = Store::open(&store_dir(images.path())).unwrap();
        let r = nestbox_store::import(
            &store,
            src.path(),
            "tiny",
            &nestbox_store::ImportOptions::default(),
            &nestbox_store::Progress::hidden(),
        )
        .unwrap();
        let img = open_image("tiny", images.path()).unwrap();
        assert_eq!(img.name(), "tiny");
        let view = img.root_view(None).unwrap();
        assert_eq!(view.layers.len(), 1);
        assert_eq!(view.layers[0].target, PathBuf::from("/"));
        let tree = &view.layers[0].lowers[0];
        assert_eq!(tree, &store.tree_path(&r.image.id));
        assert_eq!(std::fs::read(tree.join("etc/hello")).unwrap(), b"hi\n");
        assert!(tree.join("proc").is_dir(), "mount points are added");
        assert!(view.read_only.is_empty());
        let err = img.root_view(Some((1000, 1000))).unwrap_err().to_string();
        assert!(err.contains("user namespace"), "{err}");
        let err = open_image("nope", images.path()).err().unwrap().to_string();
        assert!(err.contains("\"nope\" not found"), "{err}");
    }
}
