//! `image export`: an image as a tar archive (GNU headers, PAX for xattrs and
//! sub-second mtimes), written to a temporary file and renamed, so a failed export
//! never leaves a partial archive under the requested name. Importing the result
//! gives back the same manifest, hence the same image id.

use std::fs;
use std::io::{BufWriter, Write};
use std::path::Path;

use tar::{EntryType, Header};

use crate::error::{Result, StoreError};
use crate::manifest::{Entry, Kind};
use crate::store::Store;

impl Store {
    /// Write image `name` to `out` as a tar archive.
    pub fn export(&self, name: &str, out: &Path) -> Result<()> {
        let image = self.image(name)?;
        let manifest = self.manifest(&image.id)?;
        let file_name = out.file_name().ok_or_else(|| {
            StoreError::io("create", out)(std::io::ErrorKind::InvalidInput.into())
        })?;
        let tmp = out.with_file_name(format!(
            ".{}.nestbox-tmp-{}",
            file_name.to_string_lossy(),
            std::process::id()
        ));
        let result = (|| {
            let f = fs::File::create(&tmp).map_err(StoreError::io("create", &tmp))?;
            let mut b = tar::Builder::new(BufWriter::with_capacity(1 << 20, f));
            b.follow_symlinks(false);
            for (path, entry) in &manifest.entries {
                self.append(&mut b, path, entry, &tmp)?;
            }
            let w = b.into_inner().map_err(StoreError::io("write", &tmp))?;
            let f = w
                .into_inner()
                .map_err(|e| StoreError::io("write", &tmp)(e.into_error()))?;
            f.sync_all().map_err(StoreError::io("fsync", &tmp))?;
            fs::rename(&tmp, out).map_err(StoreError::io("rename", out))
        })();
        if result.is_err() {
            crate::store::discard_file(&tmp);
        }
        result
    }

    fn append<W: Write>(
        &self,
        b: &mut tar::Builder<W>,
        path: &str,
        e: &Entry,
        tmp: &Path,
    ) -> Result<()> {
        let werr = StoreError::io("write", tmp);
        let mut pax: Vec<(String, Vec<u8>)> = e
            .meta
            .xattrs
            .iter()
            .map(|(k, v)| (format!("SCHILY.xattr.{k}"), v.0.clone()))
            .collect();
        if e.meta.mtime_nsec != 0 {
            pax.push((
                "mtime".into(),
                format!("{}.{:09}", e.meta.mtime, e.meta.mtime_nsec).into_bytes(),
            ));
        }
        if !pax.is_empty() {
            b.append_pax_extensions(pax.iter().map(|(k, v)| (k.as_str(), v.as_slice())))
                .map_err(StoreError::io("write", tmp))?;
        }
        let mut h = Header::new_gnu();
        h.set_mode(e.meta.mode);
        h.set_uid(u64::from(e.meta.uid));
        h.set_gid(u64::from(e.meta.gid));
        h.set_mtime(e.meta.mtime.max(0) as u64);
        h.set_size(0);
        let name = if path.is_empty() {
            "./".to_string()
        } else if e.is_dir() {
            format!("{path}/")
        } else {
            path.to_string()
        };
        match &e.kind {
            Kind::Dir => {
                h.set_entry_type(EntryType::Directory);
                b.append_data(&mut h, &name, std::io::empty()).map_err(werr)
            }
            Kind::File { object, size } => {
                h.set_entry_type(EntryType::Regular);
                h.set_size(*size);
                let src = self.object_path(object, &e.meta.key());
                let f = fs::File::open(&src).map_err(|err| {
                    if err.kind() == std::io::ErrorKind::NotFound {
                        StoreError::MissingObject(format!("{object} ({path})"))
                    } else {
                        StoreError::io("open", &src)(err)
                    }
                })?;
                b.append_data(&mut h, &name, f).map_err(werr)
            }
            Kind::Symlink { target } => {
                h.set_entry_type(EntryType::Symlink);
                b.append_link(&mut h, &name, target).map_err(werr)
            }
            Kind::Char { major, minor } | Kind::Block { major, minor } => {
                h.set_entry_type(if matches!(e.kind, Kind::Char { .. }) {
                    EntryType::Char
                } else {
                    EntryType::Block
                });
                h.set_device_major(*major)
                    .map_err(StoreError::io("write", tmp))?;
                h.set_device_minor(*minor)
                    .map_err(StoreError::io("write", tmp))?;
                b.append_data(&mut h, &name, std::io::empty()).map_err(werr)
            }
            Kind::Fifo => {
                h.set_entry_type(EntryType::Fifo);
                b.append_data(&mut h, &name, std::io::empty()).map_err(werr)
            }
        }
    }
}
