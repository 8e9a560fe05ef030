//! Image names: `images/NAME.json` maps a name to a manifest id. A name is
//! created atomically and exclusively (temporary file, fsync, `link(2)`, which
//! fails if the name exists), so an image becomes visible whole or not at all and
//! two imports racing for one name cannot both win.

use std::fs;
use std::io::Write;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Result, StoreError};
use crate::hash::Digest;
use crate::store::{fsync_dir, Store};

/// A named image as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageRef {
    /// The name.
    pub name: String,
    /// The manifest id (the image id).
    pub id: Digest,
    /// Unix time of creation.
    pub created: f64,
    /// Where it came from (import source, or `commit of BOX`).
    pub source: String,
    /// Regular files.
    pub files: u64,
    /// Logical bytes of regular files.
    pub bytes: u64,
}

/// The name of the built-in host image, which the store never holds.
pub const RESERVED_NAME: &str = "host";

/// Check an image name: 1–128 characters of `[A-Za-z0-9_.-]`, starting with a
/// letter or digit, not the built-in `host`.
pub fn validate_name(name: &str) -> Result<()> {
    let bad = |why| {
        Err(StoreError::BadName {
            name: name.to_string(),
            why,
        })
    };
    if name.is_empty() || name.len() > 128 {
        return bad("must be 1 to 128 characters");
    }
    if !name.as_bytes()[0].is_ascii_alphanumeric() {
        return bad("must start with a letter or digit");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        return bad("may only contain letters, digits, '_', '.' and '-'");
    }
    if name == RESERVED_NAME {
        return bad("\"host\" is the built-in host image");
    }
    Ok(())
}

impl Store {
    fn ref_path(&self, name: &str) -> PathBuf {
        self.images_dir().join(format!("{name}.json"))
    }

    /// Whether an image of that name exists.
    pub fn has_image(&self, name: &str) -> bool {
        validate_name(name).is_ok() && self.ref_path(name).exists()
    }

    /// The image named `name`.
    pub fn image(&self, name: &str) -> Result<ImageRef> {
        if validate_name(name).is_err() {
            return Err(StoreError::NoSuchImage(name.to_string()));
        }
        let path = self.ref_path(name);
        let data = match fs::read(&path) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(StoreError::NoSuchImage(name.to_string()))
            }
            Err(e) => return Err(StoreError::io("read", &path)(e)),
        };
        serde_json::from_slice(&data).map_err(|e| StoreError::corrupt(&path, e))
    }

    /// Every image, sorted by name.
    pub fn images(&self) -> Result<Vec<ImageRef>> {
        let dir = self.images_dir();
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(StoreError::io("list", &dir)(e)),
        };
        let mut out = Vec::new();
        for e in entries.flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            if let Some(name) = n.strip_suffix(".json").filter(|_| !n.starts_with('.')) {
                match self.image(name) {
                    Ok(r) => out.push(r),
                    Err(StoreError::NoSuchImage(_)) => continue,
                    Err(e) => return Err(e),
                }
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Record `r` under its name; fails with [`StoreError::NameInUse`] if taken.
    pub(crate) fn create_ref(&self, r: &ImageRef) -> Result<()> {
        let dir = self.images_dir();
        let tmp = dir.join(format!(".new-{}-{}", r.name, std::process::id()));
        let data = serde_json::to_vec_pretty(r).expect("a ref always serialises");
        let written = (|| {
            let mut f = fs::File::create(&tmp).map_err(StoreError::io("create", &tmp))?;
            f.write_all(&data).map_err(StoreError::io("write", &tmp))?;
            f.sync_all().map_err(StoreError::io("fsync", &tmp))
        })();
        if let Err(e) = written {
            crate::store::discard_file(&tmp);
            return Err(e);
        }
        let fin = self.ref_path(&r.name);
        let linked = fs::hard_link(&tmp, &fin);
        crate::store::discard_file(&tmp);
        match linked {
            Ok(()) => fsync_dir(&dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                Err(StoreError::NameInUse(r.name.clone()))
            }
            Err(e) => Err(StoreError::io("link", &fin)(e)),
        }
    }

    /// Remove the name `name` (its objects stay until `gc`).
    pub(crate) fn remove_ref(&self, name: &str) -> Result<()> {
        let path = self.ref_path(name);
        fs::remove_file(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                StoreError::NoSuchImage(name.to_string())
            } else {
                StoreError::io("unlink", &path)(e)
            }
        })?;
        fsync_dir(&self.images_dir())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(validate_name("busybox-1.36_a.b").is_ok());
        for bad in ["", "host", "-x", "a/b", "a b", "../x", &"x".repeat(129)] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
    }
}
