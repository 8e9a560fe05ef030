//! Building an image's path map from layers: each layer's whiteouts and opaque
//! directories remove what lower layers put there, then its entries are added in
//! order. Also the rules every input entry's path must obey (relative, no `..`,
//! UTF-8), and the check that a symlink's relative target stays inside the root.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{Result, StoreError};
use crate::manifest::{join, parent, Entry, Kind, Manifest, MANIFEST_VERSION};
use crate::meta::Meta;

/// One step of a layer.
#[derive(Debug, Clone)]
pub enum Op {
    /// Put an entry at a path (replacing what was there).
    Put(String, Entry),
    /// A hardlink: the path becomes the same file as `target` (an earlier entry).
    Link {
        /// The new path.
        path: String,
        /// The existing path it links to.
        target: String,
    },
}

/// What one layer (a tar stream, a directory, a box's upper directory) contributes.
#[derive(Debug, Clone, Default)]
pub struct Layer {
    /// Directories whose lower contents are hidden (`.wh..wh..opq`, overlay opaque).
    pub opaque: Vec<String>,
    /// Paths deleted from lower layers (`.wh.NAME`, overlay char 0/0).
    pub whiteouts: Vec<String>,
    /// Entries in input order.
    pub ops: Vec<Op>,
}

/// The path map being built.
#[derive(Debug, Clone)]
pub struct RootBuilder {
    entries: BTreeMap<String, Entry>,
}

impl Default for RootBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl RootBuilder {
    /// An empty root directory (0755 root:root).
    pub fn new() -> Self {
        let mut entries = BTreeMap::new();
        entries.insert(String::new(), implied_dir());
        RootBuilder { entries }
    }

    /// Start from an existing image.
    pub fn from_manifest(m: Manifest) -> Self {
        let mut b = RootBuilder { entries: m.entries };
        b.entries.entry(String::new()).or_insert_with(implied_dir);
        b
    }

    /// Current entry at `path`.
    pub fn get(&self, path: &str) -> Option<&Entry> {
        self.entries.get(path)
    }

    /// Remove `path` and everything under it.
    pub fn remove_subtree(&mut self, path: &str) {
        if path.is_empty() {
            self.remove_children("");
            return;
        }
        self.remove_children(path);
        self.entries.remove(path);
    }

    /// Remove everything under directory `path` (not the directory itself).
    pub fn remove_children(&mut self, path: &str) {
        let keys: Vec<String> = if path.is_empty() {
            self.entries
                .keys()
                .filter(|k| !k.is_empty())
                .cloned()
                .collect()
        } else {
            let lo = format!("{path}/");
            let hi = format!("{path}0");
            self.entries.range(lo..hi).map(|(k, _)| k.clone()).collect()
        };
        for k in keys {
            self.entries.remove(&k);
        }
    }

    /// Put `entry` at `path`: a non-directory replacing a directory removes its
    /// subtree; a directory over a directory only changes its metadata.
    pub fn put(&mut self, path: String, entry: Entry) {
        if let Some(old) = self.entries.get(&path) {
            if old.is_dir() && !entry.is_dir() {
                self.remove_children(&path);
            }
        }
        self.entries.insert(path, entry);
    }

    /// Apply a layer read from `src` (named in errors).
    pub fn apply(&mut self, layer: Layer, src: &Path) -> Result<()> {
        for d in &layer.opaque {
            self.remove_children(d);
        }
        for w in &layer.whiteouts {
            self.remove_subtree(w);
        }
        for op in layer.ops {
            match op {
                Op::Put(path, entry) => self.put(path, entry),
                Op::Link { path, target } => {
                    let entry = match self.entries.get(&target) {
                        Some(e) if !e.is_dir() => e.clone(),
                        Some(_) => {
                            return Err(StoreError::refused(
                                src,
                                path,
                                format!("hardlink to directory {target:?}"),
                            ))
                        }
                        None => {
                            return Err(StoreError::refused(
                                src,
                                path,
                                format!("hardlink target {target:?} does not exist"),
                            ))
                        }
                    };
                    self.put(path, entry);
                }
            }
        }
        Ok(())
    }

    /// The finished manifest: missing parent directories are added (0755
    /// root:root); a path under a non-directory (e.g. a symlink) is refused.
    pub fn finish(mut self, src: &Path) -> Result<Manifest> {
        let mut missing = Vec::new();
        for path in self.entries.keys() {
            let mut p = path.as_str();
            while let Some(up) = parent(p) {
                match self.entries.get(up) {
                    Some(e) if e.is_dir() => break,
                    Some(_) => {
                        return Err(StoreError::refused(
                            src,
                            path.clone(),
                            format!("lies under {up:?}, which is not a directory"),
                        ))
                    }
                    None => missing.push(up.to_string()),
                }
                p = up;
            }
        }
        for m in missing {
            self.entries.entry(m).or_insert_with(implied_dir);
        }
        Ok(Manifest {
            version: MANIFEST_VERSION,
            entries: self.entries,
        })
    }
}

fn implied_dir() -> Entry {
    Entry {
        kind: Kind::Dir,
        meta: Meta {
            mode: 0o755,
            ..Meta::default()
        },
    }
}

/// The clean relative path of an input entry name, or `None` for the root
/// (`.`, `./`). Absolute paths, `..` components and non-UTF-8 names are refused.
pub fn clean_path(raw: &[u8]) -> std::result::Result<Option<String>, String> {
    let text = std::str::from_utf8(raw).map_err(|_| "name is not UTF-8".to_string())?;
    if text.starts_with('/') {
        return Err("absolute path".into());
    }
    if text.contains('\0') {
        return Err("name contains NUL".into());
    }
    let mut out = String::new();
    for comp in text.split('/') {
        match comp {
            "" | "." => continue,
            ".." => return Err("path contains \"..\"".into()),
            c => out = join(&out, c),
        }
    }
    Ok((!out.is_empty()).then_some(out))
}

/// Whether a symlink at `path` with relative `target` climbs above the root.
/// Absolute targets resolve inside the box's root and are accepted.
pub fn symlink_escapes(path: &str, target: &str) -> bool {
    if target.starts_with('/') {
        return false;
    }
    let mut depth: i64 = parent(path).map_or(0, |p| {
        if p.is_empty() {
            0
        } else {
            p.split('/').count() as i64
        }
    });
    for comp in target.split('/') {
        match comp {
            "" | "." => {}
            ".." => {
                depth -= 1;
                if depth < 0 {
                    return true;
                }
            }
            _ => depth += 1,
        }
    }
    false
}

/// What a file name in a layer means: a whiteout of a sibling, the opaque marker
/// of its directory, overlay metadata to skip, or an ordinary name.
#[derive(Debug, PartialEq, Eq)]
pub enum WhiteoutName<'a> {
    /// `.wh..wh..opq`: the directory is opaque.
    Opaque,
    /// `.wh.NAME`: NAME is deleted.
    Delete(&'a str),
    /// `.wh..wh.*` (aufs bookkeeping): ignored.
    Meta,
    /// An ordinary name.
    Plain,
}

/// Classify the last component of a layer path.
pub fn whiteout_name(name: &str) -> WhiteoutName<'_> {
    if name == ".wh..wh..opq" {
        WhiteoutName::Opaque
    } else if name.starts_with(".wh..wh.") {
        WhiteoutName::Meta
    } else if let Some(rest) = name.strip_prefix(".wh.") {
        WhiteoutName::Delete(rest)
    } else {
        WhiteoutName::Plain
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::Digest;

    fn file(tag: &[u8]) -> Entry {
        Entry {
            kind: Kind::File {
                object: Digest::of(tag),
                size: tag.len() as u64,
            },
            meta: Meta {
                mode: 0o644,
                ..Meta::default()
            },
        }
    }

    #[test]
    fn paths_are_cleaned_or_refused() {
        assert_eq!(clean_path(b"./a//b/"), Ok(Some("a/b".into())));
        assert_eq!(clean_path(b"./"), Ok(None));
        assert!(clean_path(b"/etc/passwd").is_err());
        assert!(clean_path(b"a/../../x").is_err());
        assert!(clean_path(b"\xff").is_err());
    }

    #[test]
    fn symlink_escape() {
        assert!(!symlink_escapes("usr/lib/x", "../../bin/sh"));
        assert!(symlink_escapes("usr/lib/x", "../../../etc/shadow"));
        assert!(symlink_escapes("x", ".."));
        assert!(!symlink_escapes("x", "/etc/passwd"));
        assert!(!symlink_escapes("a/b", "c/../../d"));
    }

    #[test]
    fn whiteouts_and_opaque_dirs_hide_lower_layers_only() {
        let mut b = RootBuilder::new();
        let dir = Entry {
            kind: Kind::Dir,
            meta: Meta::default(),
        };
        b.apply(
            Layer {
                ops: vec![
                    Op::Put("etc".into(), dir.clone()),
                    Op::Put("etc/a".into(), file(b"a")),
                    Op::Put("etc/b".into(), file(b"b")),
                    Op::Put("opt".into(), dir.clone()),
                    Op::Put("opt/x".into(), file(b"x")),
                ],
                ..Layer::default()
            },
            Path::new("l1"),
        )
        .unwrap();
        b.apply(
            Layer {
                opaque: vec!["opt".into()],
                whiteouts: vec!["etc/a".into()],
                ops: vec![Op::Put("opt/y".into(), file(b"y"))],
            },
            Path::new("l2"),
        )
        .unwrap();
        let m = b.finish(Path::new("x")).unwrap();
        let keys: Vec<&str> = m.entries.keys().map(String::as_str).collect();
        assert_eq!(keys, vec!["", "etc", "etc/b", "opt", "opt/y"]);
    }

    #[test]
    fn file_replacing_dir_drops_subtree_and_parents_are_implied() {
        let mut b = RootBuilder::new();
        b.put("a/b/c".into(), file(b"c"));
        b.put(
            "a/b".into(),
            Entry {
                kind: Kind::Dir,
                meta: Meta::default(),
            },
        );
        b.put("a/b".into(), file(b"b"));
        let m = b.finish(Path::new("x")).unwrap();
        let keys: Vec<&str> = m.entries.keys().map(String::as_str).collect();
        assert_eq!(keys, vec!["", "a", "a/b"]);
    }

    #[test]
    fn entry_under_symlink_is_refused() {
        let mut b = RootBuilder::new();
        b.put(
            "lib".into(),
            Entry {
                kind: Kind::Symlink {
                    target: "/etc".into(),
                },
                meta: Meta::default(),
            },
        );
        b.put("lib/passwd".into(), file(b"evil"));
        let e = b.finish(Path::new("evil.tar")).unwrap_err().to_string();
        assert!(e.contains("not a directory"), "{e}");
    }

    #[test]
    fn hardlink_needs_an_existing_target() {
        let mut b = RootBuilder::new();
        let e = b
            .apply(
                Layer {
                    ops: vec![Op::Link {
                        path: "x".into(),
                        target: "nope".into(),
                    }],
                    ..Layer::default()
                },
                Path::new("t.tar"),
            )
            .unwrap_err();
        assert!(e.to_string().contains("does not exist"));
    }

    #[test]
    fn whiteout_names() {
        assert_eq!(whiteout_name(".wh..wh..opq"), WhiteoutName::Opaque);
        assert_eq!(whiteout_name(".wh.foo"), WhiteoutName::Delete("foo"));
        assert_eq!(whiteout_name(".wh..wh.plnk"), WhiteoutName::Meta);
        assert_eq!(whiteout_name("foo"), WhiteoutName::Plain);
    }
}
