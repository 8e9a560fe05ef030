//! `nestbox image|commit|store|dedup`: the content-addressed image store from the
//! command line. This file parses arguments and prints; the rules (images in use,
//! which layer a commit takes, which boxes dedup may touch) are the runtime's
//! [`nestbox_runtime::store_ops`], shared with the API.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Subcommand};
use nestbox_runtime::registry::Registry;
use nestbox_runtime::store_ops::{self, open_store};
use nestbox_store::{DedupOptions, ImportOptions, Progress};

/// `nestbox image ...`
#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Import a root filesystem: a directory, a tar/tar.gz/tar.zst, an OCI image
    /// layout (directory or archive) or a docker save archive.
    Import {
        /// The source.
        src: PathBuf,
        /// Name of the new image.
        #[arg(long)]
        name: String,
        /// No progress bar.
        #[arg(short, long)]
        quiet: bool,
        /// Accept device nodes (root only).
        #[arg(long)]
        allow_devices: bool,
    },
    /// List images.
    Ls {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show an image as JSON.
    Inspect {
        /// Image name.
        name: String,
    },
    /// Remove images (refused while a box uses one; objects go at `store gc`).
    Rm {
        /// Image names.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Write an image as a tar archive.
    Export {
        /// Image name.
        name: String,
        /// The archive to write.
        file: PathBuf,
    },
}

/// `nestbox commit BOX NAME`
#[derive(Debug, Args)]
pub struct CommitArgs {
    /// Box to commit.
    pub r#box: String,
    /// Name of the new image.
    pub name: String,
    /// No progress bar.
    #[arg(short, long)]
    pub quiet: bool,
}

/// `nestbox store ...`
#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// Logical size of images and box layers against physical bytes used.
    Df {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Re-hash every object; exit 1 if anything is corrupt.
    Verify {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove unreferenced objects, trees and stale staging areas.
    Gc {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// `nestbox dedup`
#[derive(Debug, Args)]
pub struct DedupArgs {
    /// Report only.
    #[arg(long)]
    pub dry_run: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Sample sizes of the partial-hash levels, in bytes, comma-separated.
    #[arg(long, value_name = "N,N,...", default_value = "4096,65536")]
    pub samples: String,
}

fn progress(quiet: bool, what: &str) -> Progress {
    Progress::bytes(!quiet && std::io::stderr().is_terminal(), what, None)
}

fn human(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

/// Run an `image` subcommand.
pub fn image(reg: &Registry, cmd: ImageCommand) -> Result<i32> {
    let store = open_store(reg)?;
    match cmd {
        ImageCommand::Import {
            src,
            name,
            quiet,
            allow_devices,
        } => {
            let p = progress(quiet, &format!("import {name}"));
            let r = store_ops::import(&store, &src, &name, &ImportOptions { allow_devices }, &p);
            p.finish();
            let r = r?;
            println!(
                "{} {} ({}: {} files, {}; {} new objects, {} stored, {} already shared)",
                r.image.name,
                r.image.id.short(),
                r.format.name(),
                r.image.files,
                human(r.image.bytes),
                r.stats.new_objects,
                human(r.stats.new_bytes),
                r.stats.reused_objects
            );
            Ok(0)
        }
        ImageCommand::Ls { json } => {
            let images = store.images()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&images)?);
                return Ok(0);
            }
            println!(
                "{:<24} {:<14} {:>9} {:>10}  SOURCE",
                "NAME", "ID", "FILES", "SIZE"
            );
            for i in images {
                println!(
                    "{:<24} {:<14} {:>9} {:>10}  {}",
                    i.name,
                    i.id.short(),
                    i.files,
                    human(i.bytes),
                    i.source
                );
            }
            Ok(0)
        }
        ImageCommand::Inspect { name } => {
            let info = store_ops::inspect(reg, &store, &name)?;
            println!("{}", serde_json::to_string_pretty(&info)?);
            Ok(0)
        }
        ImageCommand::Rm { names } => {
            let mut code = 0;
            for name in names {
                match store_ops::remove_image(reg, &store, &name) {
                    Ok(()) => println!("{name}"),
                    Err(e) => {
                        eprintln!("nestbox: error: {e}");
                        code = nestbox_runtime::error::EXIT_NESTBOX_ERROR;
                    }
                }
            }
            Ok(code)
        }
        ImageCommand::Export { name, file } => {
            store.export(&name, &file)?;
            Ok(0)
        }
    }
}

/// Run `commit`.
pub fn commit(reg: &Registry, args: CommitArgs) -> Result<i32> {
    let store = open_store(reg)?;
    let p = progress(args.quiet, &format!("commit {}", args.name));
    let r = store_ops::commit(reg, &store, &args.r#box, &args.name, &p);
    p.finish();
    let (image, stats) = r?;
    println!(
        "{} {} ({} files, {}; {} new objects, {} stored)",
        image.name,
        image.id.short(),
        image.files,
        human(image.bytes),
        stats.new_objects,
        human(stats.new_bytes)
    );
    Ok(0)
}

/// Run a `store` subcommand.
pub fn store(reg: &Registry, cmd: StoreCommand) -> Result<i32> {
    let store = open_store(reg)?;
    match cmd {
        StoreCommand::Df { json } => {
            let u = store_ops::usage(reg, &store)?;
            // Snapshots of box layers: their contents are objects of the
            // store (counted in its physical bytes) once each.
            let snaps = nestbox_runtime::time_travel::list(reg, None)?;
            let snap_files: u64 = snaps.iter().map(|s| s.files).sum();
            let snap_bytes: u64 = snaps.iter().map(|s| s.bytes).sum();
            let snap_added: u64 = snaps.iter().map(|s| s.new_bytes).sum();
            if json {
                let mut v = serde_json::to_value(&u)?;
                v["snapshots"] = serde_json::json!({
                    "count": snaps.len(),
                    "files": snap_files,
                    "logical_bytes": snap_bytes,
                    "stored_bytes": snap_added,
                });
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(0);
            }
            println!(
                "images:    {:>4}  {:>9} files  {:>10} logical",
                u.images,
                u.image_files,
                human(u.image_logical_bytes)
            );
            println!(
                "box layers:{:>4}  {:>9} files  {:>10} logical",
                u.layers,
                u.layer_files,
                human(u.layer_logical_bytes)
            );
            println!(
                "total logical {}, physical {} (store {}, layers {}), {} objects, sharing ratio {:.2}",
                human(u.logical_bytes),
                human(u.physical_bytes),
                human(u.store_physical_bytes),
                human(u.layer_physical_bytes),
                u.objects,
                u.sharing_ratio
            );
            println!(
                "snapshots: {:>4}  {:>9} files  {:>10} logical, {} added to the store",
                snaps.len(),
                snap_files,
                human(snap_bytes),
                human(snap_added)
            );
            let pool = nestbox_runtime::checkpoint::pool_usage(reg)?;
            println!(
                "checkpoint pages: {} distinct in {} pack(s), {}",
                pool.pages,
                pool.packs,
                human(pool.bytes)
            );
            Ok(0)
        }
        StoreCommand::Verify { json } => {
            let r = store.verify()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                for p in &r.problems {
                    println!("{p}");
                }
                println!(
                    "{}: {} objects ({}) re-hashed, {} images checked, {} problems",
                    if r.problems.is_empty() {
                        "ok"
                    } else {
                        "CORRUPT"
                    },
                    r.objects,
                    human(r.bytes),
                    r.images,
                    r.problems.len()
                );
            }
            Ok(if r.problems.is_empty() { 0 } else { 1 })
        }
        StoreCommand::Gc { json } => {
            let r = store.gc_keeping(&|| {
                nestbox_runtime::snapshots::referenced_inodes(reg)
                    .map_err(|e| nestbox_store::StoreError::Referrers(e.to_string()))
            })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                println!(
                    "removed {} objects ({}), {} trees, {} stale staging areas",
                    r.objects_removed,
                    human(r.bytes_freed),
                    r.trees_removed,
                    r.staging_removed
                );
            }
            Ok(0)
        }
    }
}

/// Run `dedup`.
pub fn dedup(reg: &Registry, args: DedupArgs) -> Result<i32> {
    let samples = store_ops::parse_samples(&args.samples)?;
    let store = open_store(reg)?;
    let outcome = store_ops::dedup(
        reg,
        &store,
        &DedupOptions {
            samples,
            dry_run: args.dry_run,
        },
    )?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&outcome)?);
        return Ok(0);
    }
    let (report, skipped) = (&outcome.report, &outcome.skipped);
    println!(
        "{} {} layers and {} store objects: {} candidate files, {}",
        if report.dry_run {
            "dry run over"
        } else {
            "deduplicated"
        },
        report.layers,
        report.objects,
        report.candidates,
        human(report.candidate_bytes)
    );
    println!(
        "{:<14} {:>9} {:>12} {:>9} {:>11}",
        "LEVEL", "FILES", "BYTES READ", "MATCHED", "COLLISIONS"
    );
    for l in &report.levels {
        println!(
            "{:<14} {:>9} {:>12} {:>9} {:>11}",
            l.level, l.files, l.bytes_read, l.matched, l.collisions
        );
    }
    let pct = if report.unique_bytes == 0 {
        0.0
    } else {
        100.0 * report.unique_bytes_read as f64 / report.unique_bytes as f64
    };
    println!(
        "{} {} files ({}) into shared objects ({} new objects); {} identical files kept apart for different metadata; {} files skipped",
        if report.dry_run { "would merge" } else { "merged" },
        report.merged_files,
        human(report.merged_bytes),
        report.new_objects,
        report.metadata_differs,
        report.skipped_files
    );
    println!(
        "unique files: {} ({}), {:.2}% of their bytes read; {:.3} s",
        report.unique_files,
        human(report.unique_bytes),
        pct,
        report.seconds
    );
    println!(
        "skipped {} boxes{}",
        skipped.len(),
        if skipped.is_empty() {
            String::new()
        } else {
            ":".into()
        }
    );
    for s in skipped {
        println!("  {}: {}", s.name, s.reason);
    }
    Ok(0)
}
