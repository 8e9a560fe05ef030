//! `image import`: recognise the source's format, read it into a manifest while
//! storing file contents, and commit the image under its name.
//!
//! | source | recognised by |
//! |---|---|
//! | OCI image layout directory | an `oci-layout` file and `index.json` |
//! | docker save directory (unpacked) | a `manifest.json` listing `Layers` |
//! | root filesystem directory | any other directory |
//! | OCI archive / docker save archive | a tar whose members include `oci-layout` / `manifest.json` (compressed ones are unpacked to the staging area first) |
//! | root filesystem archive | any other tar, plain, gzip or zstd |

pub mod blobs;
pub mod dir;
pub mod oci;
pub mod tar;

use std::fs;
use std::io::Read;
use std::path::Path;

use crate::error::{Result, StoreError};
use crate::layer::RootBuilder;
use crate::progress::{CountingReader, Progress};
use crate::refs::{validate_name, ImageRef};
use crate::store::Store;
use crate::txn::{Txn, TxnStats};
use blobs::Blobs;

/// Options of an import.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImportOptions {
    /// Accept device nodes (the caller must also be root).
    pub allow_devices: bool,
}

/// The kinds of source an import understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// A root filesystem directory.
    Dir,
    /// A root filesystem tar (plain, gzip or zstd).
    Tar,
    /// An OCI image layout directory.
    OciDir,
    /// An OCI image layout in a tar.
    OciArchive,
    /// An unpacked `docker save` directory.
    DockerDir,
    /// A `docker save` tar.
    DockerArchive,
}

impl Format {
    /// Short name for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Format::Dir => "directory",
            Format::Tar => "root filesystem archive",
            Format::OciDir => "OCI image layout",
            Format::OciArchive => "OCI image archive",
            Format::DockerDir => "docker save directory",
            Format::DockerArchive => "docker save archive",
        }
    }
}

/// What an import did.
#[derive(Debug, Clone)]
pub struct ImportReport {
    /// The new image.
    pub image: ImageRef,
    /// The format recognised.
    pub format: Format,
    /// Object counters.
    pub stats: TxnStats,
}

/// Member names that mark an OCI layout or docker save archive.
fn archive_kind(names: &mut dyn Iterator<Item = String>) -> Option<Format> {
    let mut docker = false;
    for n in names {
        let n = n.trim_start_matches("./").to_string();
        if n == "oci-layout" {
            return Some(Format::OciArchive);
        }
        if n == "manifest.json" {
            docker = true;
        }
    }
    docker.then_some(Format::DockerArchive)
}

/// Recognise the format of `src`.
pub fn detect(src: &Path) -> Result<Format> {
    let md = fs::metadata(src).map_err(StoreError::io("stat", src))?;
    if md.is_dir() {
        if src.join("oci-layout").is_file() && src.join("index.json").is_file() {
            return Ok(Format::OciDir);
        }
        if src.join("manifest.json").is_file() && !src.join("etc").exists() {
            return Ok(Format::DockerDir);
        }
        return Ok(Format::Dir);
    }
    let mut head = [0u8; 512];
    let n = read_up_to(src, &mut head)?;
    match tar::sniff(&head[..n]) {
        tar::Compression::None => {
            if n < 512 || !tar::is_tar_header(&head) {
                return Err(StoreError::UnknownFormat(src.to_path_buf()));
            }
            let f = fs::File::open(src).map_err(StoreError::io("open", src))?;
            let mut a = ::tar::Archive::new(f);
            let entries = a
                .entries_with_seek()
                .map_err(|e| StoreError::corrupt(src, e))?;
            let mut names = entries
                .map_while(|e| e.ok())
                .map(|e| String::from_utf8_lossy(&e.path_bytes()).to_string());
            Ok(archive_kind(&mut names).unwrap_or(Format::Tar))
        }
        _ => {
            // A compressed tar: peek at its first members.
            let f = fs::File::open(src).map_err(StoreError::io("open", src))?;
            let stream = tar::decompressed(f, src)?;
            let mut peek = [0u8; 512];
            let mut s = stream;
            let got = read_full(&mut s, &mut peek).map_err(|e| StoreError::corrupt(src, e))?;
            if got < 512 || !tar::is_tar_header(&peek) {
                return Err(StoreError::UnknownFormat(src.to_path_buf()));
            }
            let f = fs::File::open(src).map_err(StoreError::io("open", src))?;
            let mut a = ::tar::Archive::new(tar::decompressed(f, src)?);
            let kind = match a.entries() {
                Ok(entries) => {
                    let mut names = entries
                        .take(16)
                        .map_while(|e| e.ok())
                        .map(|e| String::from_utf8_lossy(&e.path_bytes()).to_string());
                    archive_kind(&mut names)
                }
                Err(_) => None,
            };
            Ok(kind.unwrap_or(Format::Tar))
        }
    }
}

fn read_up_to(src: &Path, buf: &mut [u8]) -> Result<usize> {
    let mut f = fs::File::open(src).map_err(StoreError::io("open", src))?;
    read_full(&mut f, buf).map_err(StoreError::io("read", src))
}

fn read_full(r: &mut dyn Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Import `src` as image `name`.
pub fn import(
    store: &Store,
    src: &Path,
    name: &str,
    opts: &ImportOptions,
    progress: &Progress,
) -> Result<ImportReport> {
    validate_name(name)?;
    if store.has_image(name) {
        return Err(StoreError::NameInUse(name.to_string()));
    }
    let format = detect(src)?;
    let txn = Txn::begin(store)?;
    let mut root = RootBuilder::new();
    match format {
        Format::Dir => {
            let layer = dir::read_tree(
                src,
                dir::TreeKind::Rootfs {
                    allow_devices: opts.allow_devices,
                },
                &txn,
                progress,
            )?;
            root.apply(layer, src)?;
        }
        Format::Tar => {
            let size = fs::metadata(src).map(|m| m.len()).unwrap_or(0);
            progress.set_total(size);
            let f = fs::File::open(src).map_err(StoreError::io("open", src))?;
            let stream = tar::decompressed(CountingReader::new(f, progress), src)?;
            let layer = tar::read_layer(stream, &txn, src, opts)?;
            root.apply(layer, src)?;
        }
        Format::OciDir | Format::DockerDir => {
            let blobs = Blobs::Dir(src.to_path_buf());
            let layers = if format == Format::OciDir {
                oci::oci_layers(&blobs)?
            } else {
                oci::docker_layers(&blobs)?
            };
            oci::apply_layers(&blobs, &layers, &mut root, &txn, opts, progress)?;
        }
        Format::OciArchive | Format::DockerArchive => {
            let mut head = [0u8; 4];
            let n = read_up_to(src, &mut head)?;
            let plain = if tar::sniff(&head[..n]) == tar::Compression::None {
                src.to_path_buf()
            } else {
                // Blobs are read in place, which needs an uncompressed archive.
                let tmp = txn.scratch("archive.tar");
                let f = fs::File::open(src).map_err(StoreError::io("open", src))?;
                let mut stream = tar::decompressed(f, src)?;
                let mut out = fs::File::create(&tmp).map_err(StoreError::io("create", &tmp))?;
                std::io::copy(&mut stream, &mut out).map_err(|e| StoreError::corrupt(src, e))?;
                tmp
            };
            let blobs = Blobs::index_tar(&plain)?;
            let blobs = match blobs {
                Blobs::Tar { index, .. } => Blobs::Tar { file: plain, index },
                other => other,
            };
            let layers = if format == Format::OciArchive {
                oci::oci_layers(&blobs)?
            } else {
                oci::docker_layers(&blobs)?
            };
            oci::apply_layers(&blobs, &layers, &mut root, &txn, opts, progress)
                .map_err(|e| rename_source(e, &blobs, src))?;
        }
    }
    let manifest = root.finish(src)?;
    let stats = txn.stats();
    let source = format!("{} {}", format.name(), src.display());
    let image = txn.commit_image(name, &manifest, &source)?;
    progress.finish();
    Ok(ImportReport {
        image,
        format,
        stats,
    })
}

/// Errors about a decompressed scratch copy name the user's file instead.
fn rename_source(e: StoreError, blobs: &Blobs, src: &Path) -> StoreError {
    let scratch = blobs.source();
    if scratch == src {
        return e;
    }
    match e {
        StoreError::Corrupt { path, why } if path.starts_with(scratch) => StoreError::Corrupt {
            path: src.join(path.strip_prefix(scratch).unwrap_or(&path)),
            why,
        },
        StoreError::Refused { path, entry, why } if path.starts_with(scratch) => {
            StoreError::Refused {
                path: src.join(path.strip_prefix(scratch).unwrap_or(&path)),
                entry,
                why,
            }
        }
        other => other,
    }
}
