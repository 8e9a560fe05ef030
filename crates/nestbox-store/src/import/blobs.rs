//! Named files inside an image layout or archive: a directory, or an uncompressed
//! tar indexed once by header (offset and size of every member, symlinked members
//! resolved), so each blob is then read in place without unpacking the archive.

use std::collections::HashMap;
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::error::{Result, StoreError};
use crate::layer::clean_path;
use crate::manifest::{join, parent};

/// Where blobs come from.
#[derive(Debug)]
pub enum Blobs {
    /// Files under a directory.
    Dir(PathBuf),
    /// Members of an uncompressed tar file.
    Tar {
        /// The archive.
        file: PathBuf,
        /// Member name → (data offset, size).
        index: HashMap<String, (u64, u64)>,
    },
}

impl Blobs {
    /// Index the members of the tar file `file`.
    pub fn index_tar(file: &Path) -> Result<Self> {
        let f = fs::File::open(file).map_err(StoreError::io("open", file))?;
        let mut archive = tar::Archive::new(f);
        let mut index = HashMap::new();
        let mut links: Vec<(String, String)> = Vec::new();
        let corrupt = |e: std::io::Error| StoreError::corrupt(file, e);
        for entry in archive.entries_with_seek().map_err(corrupt)? {
            let entry = entry.map_err(corrupt)?;
            let Ok(Some(name)) = clean_path(&entry.path_bytes()) else {
                continue;
            };
            match entry.header().entry_type() {
                tar::EntryType::Regular | tar::EntryType::Continuous => {
                    index.insert(name, (entry.raw_file_position(), entry.size()));
                }
                tar::EntryType::Symlink | tar::EntryType::Link => {
                    if let Some(t) = entry.link_name_bytes() {
                        let t = String::from_utf8_lossy(&t).to_string();
                        let resolved = if entry.header().entry_type() == tar::EntryType::Symlink {
                            join(parent(&name).unwrap_or(""), &t)
                        } else {
                            t
                        };
                        links.push((name, resolved));
                    }
                }
                _ => {}
            }
        }
        for (name, target) in links {
            if let Some(hit) = normalize(&target).and_then(|t| index.get(&t).copied()) {
                index.insert(name, hit);
            }
        }
        Ok(Blobs::Tar {
            file: file.to_path_buf(),
            index,
        })
    }

    /// The input this reads from (for messages).
    pub fn source(&self) -> &Path {
        match self {
            Blobs::Dir(p) => p,
            Blobs::Tar { file, .. } => file,
        }
    }

    /// Whether member `name` exists.
    pub fn exists(&self, name: &str) -> bool {
        match self {
            Blobs::Dir(root) => normalize(name).is_some_and(|n| root.join(n).is_file()),
            Blobs::Tar { index, .. } => normalize(name).is_some_and(|n| index.contains_key(&n)),
        }
    }

    /// Size of member `name`.
    pub fn size(&self, name: &str) -> Option<u64> {
        let n = normalize(name)?;
        match self {
            Blobs::Dir(root) => fs::metadata(root.join(n)).ok().map(|m| m.len()),
            Blobs::Tar { index, .. } => index.get(&n).map(|(_, s)| *s),
        }
    }

    /// Open member `name`.
    pub fn open(&self, name: &str) -> Result<Box<dyn Read>> {
        let missing = || StoreError::corrupt(self.source(), format!("{name:?} is missing"));
        let n = normalize(name).ok_or_else(missing)?;
        match self {
            Blobs::Dir(root) => {
                let p = root.join(&n);
                match fs::File::open(&p) {
                    Ok(f) => Ok(Box::new(f)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(missing()),
                    Err(e) => Err(StoreError::io("open", p)(e)),
                }
            }
            Blobs::Tar { file, index } => {
                let (off, size) = *index.get(&n).ok_or_else(missing)?;
                let mut f = fs::File::open(file).map_err(StoreError::io("open", file))?;
                f.seek(SeekFrom::Start(off))
                    .map_err(StoreError::io("seek", file))?;
                Ok(Box::new(f.take(size)))
            }
        }
    }

    /// Read member `name` whole (small JSON documents).
    pub fn read(&self, name: &str) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.open(name)?
            .take(64 << 20)
            .read_to_end(&mut out)
            .map_err(|e| StoreError::corrupt(self.source(), format!("{name}: {e}")))?;
        Ok(out)
    }
}

/// A member name reduced to the clean form the index uses (`..` resolved within
/// the archive; climbing out is refused).
fn normalize(name: &str) -> Option<String> {
    let mut parts: Vec<&str> = Vec::new();
    for c in name.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            c => parts.push(c),
        }
    }
    let joined = parts.join("/");
    clean_path(joined.as_bytes()).ok().flatten()
}
