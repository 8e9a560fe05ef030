//! `commit`: a box's root as a new image — the box's image manifest with the
//! box's overlayfs upper directory applied on top (whiteouts delete, opaque
//! directories hide lower contents, everything else replaces). Only files present
//! in the upper directory are hashed, and only contents (or metadata) the store
//! does not already hold become new objects.

use std::path::Path;

use crate::error::Result;
use crate::import::dir::{read_tree, TreeKind};
use crate::layer::{Layer, Op, RootBuilder};
use crate::progress::Progress;
use crate::refs::{validate_name, ImageRef};
use crate::snapshot::{scan_upper, Contents, LayerManifest};
use crate::store::Store;
use crate::txn::{Txn, TxnStats};
use crate::Manifest;
use crate::StoreError;

impl Store {
    /// Make image `name` from image `base` plus the overlay upper directory `upper`.
    /// `what` describes the origin (e.g. `commit of box web`).
    pub fn commit_upper(
        &self,
        base: &str,
        upper: &Path,
        name: &str,
        what: &str,
        progress: &Progress,
    ) -> Result<(ImageRef, TxnStats)> {
        let (manifest, txn) = self.begin_commit(base, name)?;
        let mut root = RootBuilder::from_manifest(manifest);
        if upper.exists() {
            let layer = read_tree(upper, TreeKind::Upper, &txn, progress)?;
            root.apply(layer, upper)?;
        }
        let manifest = root.finish(upper)?;
        let stats = txn.stats();
        let image = txn.commit_image(name, &manifest, what)?;
        progress.finish();
        Ok((image, stats))
    }

    /// A commit's start: `name` checked (valid, free), image `base`'s
    /// manifest, and the transaction the new image's objects go in.
    fn begin_commit(&self, base: &str, name: &str) -> Result<(Manifest, Txn<'_>)> {
        validate_name(name)?;
        if self.has_image(name) {
            return Err(StoreError::NameInUse(name.to_string()));
        }
        let base = self.image(base)?;
        let manifest = self.manifest(&base.id)?;
        Ok((manifest, Txn::begin(self)?))
    }

    /// [`Store::commit_upper`] for a box rolled back to a snapshot: image
    /// `base`, then the snapshot layer `below` (its objects are in the store),
    /// then the overlay upper directory `upper`.
    pub fn commit_rolled_back(
        &self,
        base: &str,
        below: &LayerManifest,
        upper: &Path,
        name: &str,
        what: &str,
    ) -> Result<(ImageRef, TxnStats)> {
        let (manifest, txn) = self.begin_commit(base, name)?;
        let on_top = if upper.exists() {
            scan_upper(upper, None, Contents::Store(&txn))?.0
        } else {
            LayerManifest::empty()
        };
        let layer = below.compose(&on_top);
        let mut apply = Layer::default();
        for (path, e) in layer.entries {
            if e.is_whiteout() {
                apply.whiteouts.push(path);
                continue;
            }
            if e.opaque {
                apply.opaque.push(path.clone());
            }
            apply.ops.push(Op::Put(path, e.entry));
        }
        let mut root = RootBuilder::from_manifest(manifest);
        root.apply(apply, upper)?;
        let manifest = root.finish(upper)?;
        let stats = txn.stats();
        let image = txn.commit_image(name, &manifest, what)?;
        Ok((image, stats))
    }
}
