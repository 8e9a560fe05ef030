//! Reading one tar stream (a root filesystem archive, or one layer of an OCI or
//! docker image) into a [`Layer`]: regular file contents go to the store as they
//! are read; names are checked (no absolute paths, no `..`, no symlink climbing
//! above the root, hardlinks only to earlier entries); device nodes only when
//! allowed; whiteouts become deletions; a stream that ends without the
//! end-of-archive marker is reported as truncated.

use std::cell::Cell;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::rc::Rc;

use tar::EntryType;

use crate::error::{Result, StoreError};
use crate::import::ImportOptions;
use crate::layer::{clean_path, symlink_escapes, whiteout_name, Layer, Op, WhiteoutName};
use crate::manifest::{join, parent, Entry, Kind};
use crate::meta::{is_overlay_xattr, Meta, XattrValue};
use crate::txn::Txn;

/// Compression of a stream, from its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Plain.
    None,
    /// gzip.
    Gzip,
    /// Zstandard.
    Zstd,
}

/// Detect the compression from the first bytes of a stream.
pub fn sniff(head: &[u8]) -> Compression {
    if head.starts_with(&[0x1f, 0x8b]) {
        Compression::Gzip
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Compression::Zstd
    } else {
        Compression::None
    }
}

/// `inner` decompressed according to its first bytes.
pub fn decompressed<'a, R: Read + 'a>(inner: R, src: &Path) -> Result<Box<dyn Read + 'a>> {
    let mut buf = BufReader::with_capacity(1 << 16, inner);
    let head = buf
        .fill_buf()
        .map_err(|e| StoreError::corrupt(src, e))?
        .to_vec();
    Ok(match sniff(&head) {
        Compression::None => Box::new(buf),
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(buf)),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::with_buffer(buf)
                .map_err(|e| StoreError::corrupt(src, e))?,
        ),
    })
}

/// Whether a 512-byte block is a tar header (valid checksum).
pub fn is_tar_header(block: &[u8]) -> bool {
    if block.len() < 512 || block.iter().all(|b| *b == 0) {
        return false;
    }
    let field = &block[148..156];
    let text: String = field
        .iter()
        .take_while(|b| **b != 0 && **b != b' ')
        .map(|b| *b as char)
        .collect();
    let Ok(want) = u32::from_str_radix(text.trim(), 8) else {
        return false;
    };
    let sum: u32 = block[..148]
        .iter()
        .chain(&block[156..512])
        .map(|b| u32::from(*b))
        .sum::<u32>()
        + 8 * u32::from(b' ');
    sum == want
}

/// Notes whether the wrapped reader ever reached its end.
struct EofWatch<R> {
    inner: R,
    hit: Rc<Cell<bool>>,
}

impl<R: Read> Read for EofWatch<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && !buf.is_empty() {
            self.hit.set(true);
        }
        Ok(n)
    }
}

/// Read a whole tar stream as one layer. `src` names the input in errors.
pub fn read_layer(
    reader: impl Read,
    txn: &Txn<'_>,
    src: &Path,
    opts: &ImportOptions,
) -> Result<Layer> {
    let hit = Rc::new(Cell::new(false));
    let mut archive = tar::Archive::new(EofWatch {
        inner: reader,
        hit: hit.clone(),
    });
    let mut layer = Layer::default();
    let corrupt = |e: std::io::Error| StoreError::corrupt(src, e);
    let mut count = 0u64;
    for entry in archive.entries().map_err(corrupt)? {
        let mut entry = entry.map_err(corrupt)?;
        count += 1;
        let raw = entry.path_bytes().into_owned();
        let shown = String::from_utf8_lossy(&raw).to_string();
        let refused = |why: String| StoreError::refused(src, shown.clone(), why);
        let etype = entry.header().entry_type();
        if matches!(
            etype,
            EntryType::XGlobalHeader
                | EntryType::XHeader
                | EntryType::GNULongName
                | EntryType::GNULongLink
        ) {
            continue;
        }
        let path = clean_path(&raw).map_err(refused)?;
        let name = path
            .as_deref()
            .map(|p| p.rsplit('/').next().unwrap_or(p))
            .unwrap_or("");
        match whiteout_name(name) {
            WhiteoutName::Plain => {}
            WhiteoutName::Meta => continue,
            WhiteoutName::Opaque => {
                let dir = parent(path.as_deref().unwrap_or("")).unwrap_or("");
                layer.opaque.push(dir.to_string());
                continue;
            }
            WhiteoutName::Delete(victim) => {
                let dir = parent(path.as_deref().unwrap_or("")).unwrap_or("");
                layer.whiteouts.push(join(dir, victim));
                continue;
            }
        }
        let meta = entry_meta(&mut entry, src, &shown)?;
        let Some(path) = path else {
            if etype != EntryType::Directory {
                return Err(refused("the root must be a directory".into()));
            }
            layer.ops.push(Op::Put(
                String::new(),
                Entry {
                    kind: Kind::Dir,
                    meta,
                },
            ));
            continue;
        };
        let kind = match etype {
            EntryType::Directory => Kind::Dir,
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                let (object, size) = txn
                    .put_reader(&mut entry, &meta, &corrupt, &|_| {})
                    .map_err(|e| match e {
                        // Metadata the store cannot keep: say which entry has it.
                        StoreError::Unsupported(why) => refused(why),
                        e => e,
                    })?;
                Kind::File { object, size }
            }
            EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| refused("symlink without a target".into()))?;
                let target = std::str::from_utf8(&target)
                    .map_err(|_| refused("symlink target is not UTF-8".into()))?
                    .to_string();
                if symlink_escapes(&path, &target) {
                    return Err(refused(format!(
                        "symlink target {target:?} climbs above the image root"
                    )));
                }
                Kind::Symlink { target }
            }
            EntryType::Link => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| refused("hardlink without a target".into()))?;
                let target = clean_path(&target)
                    .map_err(|why| refused(format!("hardlink target: {why}")))?
                    .ok_or_else(|| refused("hardlink to the root".into()))?;
                layer.ops.push(Op::Link { path, target });
                continue;
            }
            EntryType::Char | EntryType::Block => {
                let major = entry.header().device_major().ok().flatten().unwrap_or(0);
                let minor = entry.header().device_minor().ok().flatten().unwrap_or(0);
                let c = if etype == EntryType::Char { 'c' } else { 'b' };
                if !opts.allow_devices {
                    return Err(refused(format!(
                        "device node ({c} {major}:{minor}) needs --allow-devices"
                    )));
                }
                if !nix::unistd::geteuid().is_root() {
                    return Err(refused(format!(
                        "device node ({c} {major}:{minor}) can only be imported as root"
                    )));
                }
                if etype == EntryType::Char {
                    Kind::Char { major, minor }
                } else {
                    Kind::Block { major, minor }
                }
            }
            EntryType::Fifo => Kind::Fifo,
            other => {
                return Err(refused(format!(
                    "unsupported tar entry type {:?}",
                    other.as_byte() as char
                )))
            }
        };
        layer.ops.push(Op::Put(path, Entry { kind, meta }));
    }
    if hit.get() {
        return Err(StoreError::corrupt(
            src,
            if count == 0 {
                "empty archive (no end-of-archive marker)".to_string()
            } else {
                format!("archive ends after {count} entries without its end-of-archive marker (truncated?)")
            },
        ));
    }
    Ok(layer)
}

/// Mode, owner, mtime (with PAX fractions) and PAX xattrs of a tar entry.
fn entry_meta<R: Read>(entry: &mut tar::Entry<'_, R>, src: &Path, shown: &str) -> Result<Meta> {
    let bad = |what: &str, e: std::io::Error| {
        StoreError::corrupt(src, format!("entry {shown:?}: {what}: {e}"))
    };
    let h = entry.header();
    let mode = h.mode().map_err(|e| bad("mode", e))? & 0o7777;
    let uid = h.uid().map_err(|e| bad("uid", e))?;
    let gid = h.gid().map_err(|e| bad("gid", e))?;
    let mtime = h.mtime().map_err(|e| bad("mtime", e))?;
    let mut meta = Meta {
        mode,
        uid: u32::try_from(uid).map_err(|_| StoreError::refused(src, shown, "uid out of range"))?,
        gid: u32::try_from(gid).map_err(|_| StoreError::refused(src, shown, "gid out of range"))?,
        mtime: i64::try_from(mtime).unwrap_or(i64::MAX),
        mtime_nsec: 0,
        xattrs: Default::default(),
    };
    if let Some(exts) = entry.pax_extensions().map_err(|e| bad("pax header", e))? {
        for ext in exts {
            let ext = ext.map_err(|e| bad("pax header", e))?;
            let Ok(key) = ext.key() else { continue };
            if let Some(name) = key.strip_prefix("SCHILY.xattr.") {
                // The kernel validates a file capability when it is set, except
                // an empty one, which it stores and then cannot read back.
                if name == "security.capability" && ext.value_bytes().is_empty() {
                    return Err(StoreError::refused(
                        src,
                        shown,
                        "empty security.capability xattr",
                    ));
                }
                if !is_overlay_xattr(name) {
                    meta.xattrs
                        .insert(name.to_string(), XattrValue(ext.value_bytes().to_vec()));
                }
            } else if key == "mtime" {
                if let Some((secs, frac)) = ext.value().ok().and_then(parse_pax_time) {
                    meta.mtime = secs;
                    meta.mtime_nsec = frac;
                }
            }
        }
    }
    Ok(meta)
}

/// "SECONDS[.FRACTION]" → (seconds, nanoseconds).
fn parse_pax_time(text: &str) -> Option<(i64, u32)> {
    let (s, f) = text.split_once('.').unwrap_or((text, ""));
    let secs: i64 = s.parse().ok()?;
    let mut digits: String = f.chars().take(9).filter(char::is_ascii_digit).collect();
    while digits.len() < 9 {
        digits.push('0');
    }
    let nsec: u32 = digits.parse().ok()?;
    if secs < 0 && nsec > 0 {
        return Some((secs - 1, 1_000_000_000 - nsec));
    }
    Some((secs, nsec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pax_times() {
        assert_eq!(parse_pax_time("12.5"), Some((12, 500_000_000)));
        assert_eq!(parse_pax_time("7"), Some((7, 0)));
        assert_eq!(parse_pax_time("x"), None);
    }

    #[test]
    fn compression_magic() {
        assert_eq!(sniff(&[0x1f, 0x8b, 8]), Compression::Gzip);
        assert_eq!(sniff(&[0x28, 0xb5, 0x2f, 0xfd]), Compression::Zstd);
        assert_eq!(sniff(b"abc"), Compression::None);
    }
}
