//! OCI image layouts and `docker save` archives: find the image's layers (the
//! OCI index → manifest chain, or docker's `manifest.json`), check every blob
//! against its sha256 digest, and apply the layers in order.

use std::io::Read;
use std::path::Path;

use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use crate::error::{Result, StoreError};
use crate::import::blobs::Blobs;
use crate::import::tar::{decompressed, read_layer};
use crate::import::ImportOptions;
use crate::layer::RootBuilder;
use crate::progress::{CountingReader, Progress};
use crate::txn::Txn;

#[derive(Debug, Deserialize)]
struct Descriptor {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    digest: String,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Debug, Deserialize)]
struct Platform {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    os: String,
}

#[derive(Debug, Deserialize)]
struct Index {
    manifests: Vec<Descriptor>,
}

#[derive(Debug, Deserialize)]
struct ImageManifest {
    layers: Vec<Descriptor>,
}

#[derive(Debug, Deserialize)]
struct DockerImage {
    #[serde(rename = "Layers")]
    layers: Vec<String>,
}

/// The blob path of an OCI digest (`sha256:HEX` → `blobs/sha256/HEX`).
fn blob_path(src: &Path, digest: &str) -> Result<String> {
    let (alg, hex) = digest
        .split_once(':')
        .filter(|(a, h)| {
            !a.is_empty()
                && a.bytes().all(|b| b.is_ascii_alphanumeric())
                && !h.is_empty()
                && h.bytes().all(|b| b.is_ascii_hexdigit())
        })
        .ok_or_else(|| StoreError::corrupt(src, format!("bad digest {digest:?}")))?;
    Ok(format!("blobs/{alg}/{hex}"))
}

/// The sha256 hex a blob path promises, if it names one.
fn promised_sha256(path: &str) -> Option<String> {
    let mut parts = path.trim_start_matches("./").split('/');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some("blobs"), Some("sha256"), Some(hex), None) if hex.len() == 64 => {
            Some(hex.to_ascii_lowercase())
        }
        _ => None,
    }
}

/// A reader that computes the sha256 of everything read through it.
struct Sha256Reader<R> {
    inner: R,
    hasher: Sha256,
}

impl<R: Read> Read for Sha256Reader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

fn check_sha256(src: &Path, name: &str, data: &[u8]) -> Result<()> {
    if let Some(want) = promised_sha256(name) {
        let got = crate::hash::hex(&Sha256::digest(data));
        if got != want {
            return Err(StoreError::corrupt(
                src,
                format!("{name}: content does not match its sha256 digest"),
            ));
        }
    }
    Ok(())
}

fn parse_json<T: for<'de> Deserialize<'de>>(blobs: &Blobs, name: &str) -> Result<T> {
    let data = blobs.read(name)?;
    check_sha256(blobs.source(), name, &data)?;
    serde_json::from_slice(&data)
        .map_err(|e| StoreError::corrupt(blobs.source(), format!("{name}: {e}")))
}

/// The layer blob paths of the OCI layout in `blobs`.
pub fn oci_layers(blobs: &Blobs) -> Result<Vec<String>> {
    let src = blobs.source();
    let mut index: Index = parse_json(blobs, "index.json")?;
    for _depth in 0..4 {
        let pick = pick_manifest(&mut index.manifests)
            .ok_or_else(|| StoreError::corrupt(src, "index.json lists no image"))?;
        let path = blob_path(src, &pick.digest)?;
        if pick.media_type.contains("index") || pick.media_type.contains("manifest.list") {
            index = parse_json(blobs, &path)?;
            continue;
        }
        let m: ImageManifest = parse_json(blobs, &path)?;
        return m.layers.iter().map(|l| blob_path(src, &l.digest)).collect();
    }
    Err(StoreError::corrupt(src, "image indexes nested too deeply"))
}

/// The image of the host's platform if listed, else the first.
fn pick_manifest(list: &mut Vec<Descriptor>) -> Option<Descriptor> {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    let pos = list
        .iter()
        .position(|d| {
            d.platform
                .as_ref()
                .is_some_and(|p| p.os == "linux" && p.architecture == arch)
        })
        .unwrap_or(0);
    (!list.is_empty()).then(|| list.swap_remove(pos))
}

/// The layer paths of the (first) image of a docker save archive.
pub fn docker_layers(blobs: &Blobs) -> Result<Vec<String>> {
    let images: Vec<DockerImage> = parse_json(blobs, "manifest.json")?;
    let first = images
        .into_iter()
        .next()
        .ok_or_else(|| StoreError::corrupt(blobs.source(), "manifest.json lists no image"))?;
    Ok(first.layers)
}

/// Apply every layer in order onto `root`.
pub fn apply_layers(
    blobs: &Blobs,
    layers: &[String],
    root: &mut RootBuilder,
    txn: &Txn<'_>,
    opts: &ImportOptions,
    progress: &Progress,
) -> Result<()> {
    let src = blobs.source();
    let total: u64 = layers.iter().filter_map(|l| blobs.size(l)).sum();
    progress.set_total(total);
    for (i, name) in layers.iter().enumerate() {
        progress.set_message(&format!("layer {}/{}", i + 1, layers.len()));
        let label = src.join(name);
        let mut hashing = Sha256Reader {
            inner: CountingReader::new(blobs.open(name)?, progress),
            hasher: Sha256::new(),
        };
        let layer = {
            let stream = decompressed(&mut hashing, &label)?;
            read_layer(stream, txn, &label, opts)?
        };
        // Drain what the tar reader did not need (padding), for the digest.
        std::io::copy(&mut hashing, &mut std::io::sink())
            .map_err(|e| StoreError::corrupt(&label, e))?;
        if let Some(want) = promised_sha256(name) {
            let got = crate::hash::hex(&hashing.hasher.finalize());
            if got != want {
                return Err(StoreError::corrupt(
                    src,
                    format!("layer {name}: content does not match its sha256 digest"),
                ));
            }
        }
        root.apply(layer, &label)?;
    }
    Ok(())
}
