//! `nestbox snapshot BOX [NAME]`, `snapshot ls|rm`, `rollback BOX SNAP` and
//! `diff BOX [SNAP]`: the time-travel disk of a box (see docs/snapshots.md).

use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use nestbox_runtime::registry::Registry;
use nestbox_runtime::time_travel;
use serde_json::json;

/// `nestbox snapshot ...`
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct SnapshotArgs {
    #[command(subcommand)]
    cmd: Option<SnapshotCommand>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Box name.
    #[arg(value_name = "BOX", required = true)]
    r#box: Option<String>,
    /// Snapshot name (default: snap-N).
    #[arg(value_name = "NAME")]
    name: Option<String>,
    /// Checkpoint the box's processes with its files, in one freeze (the box
    /// must run): a rollback to this snapshot then puts them back too.
    #[arg(long)]
    checkpoint: bool,
}

#[derive(Debug, Subcommand)]
enum SnapshotCommand {
    /// List snapshots (of one box, or of every box).
    Ls {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Box name.
        #[arg(value_name = "BOX")]
        r#box: Option<String>,
    },
    /// Remove snapshots of a box (their contents go at `store gc` when no
    /// other snapshot or image has them).
    Rm {
        /// Box name.
        #[arg(value_name = "BOX")]
        r#box: String,
        /// Snapshot names.
        #[arg(required = true, value_name = "NAME")]
        names: Vec<String>,
    },
}

/// `nestbox rollback BOX SNAP`
#[derive(Debug, Args)]
pub struct RollbackArgs {
    /// Seconds to wait for a running box to stop before SIGKILL.
    #[arg(short = 't', long = "time", default_value_t = 10)]
    time: u64,
    /// Print JSON (timings).
    #[arg(long)]
    json: bool,
    /// Box name.
    #[arg(value_name = "BOX")]
    r#box: String,
    /// Snapshot name.
    #[arg(value_name = "SNAP")]
    snapshot: String,
}

/// `nestbox diff BOX [SNAP]`
#[derive(Debug, Args)]
pub struct DiffArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Box name.
    #[arg(value_name = "BOX")]
    r#box: String,
    /// Compare with this snapshot (default: with the box's image).
    #[arg(value_name = "SNAP")]
    snapshot: Option<String>,
}

fn human(bytes: u64) -> String {
    nestbox_runtime::size::format_size(bytes)
}

/// Run `snapshot`.
pub fn snapshot(reg: &Registry, a: SnapshotArgs) -> Result<i32> {
    match a.cmd {
        Some(SnapshotCommand::Ls { json, r#box }) => {
            let all = time_travel::list(reg, r#box.as_deref())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&all)?);
                return Ok(0);
            }
            println!(
                "{:<20} {:<20} {:>8} {:>10} {:>10} {:>8} {:<9}",
                "BOX", "SNAPSHOT", "FILES", "SIZE", "ADDED", "MS", "PROCESSES"
            );
            for s in all {
                println!(
                    "{:<20} {:<20} {:>8} {:>10} {:>10} {:>8.1} {:<9}",
                    s.box_name,
                    s.name,
                    s.files,
                    human(s.bytes),
                    human(s.new_bytes),
                    s.ms,
                    if s.processes { "yes" } else { "no" }
                );
            }
            Ok(0)
        }
        Some(SnapshotCommand::Rm { r#box, names }) => {
            let mut failed = None;
            for name in names {
                if let Err(e) = time_travel::remove(reg, &r#box, &name) {
                    eprintln!("nestbox: error: {e}");
                    failed = Some(e.exit_code());
                }
            }
            Ok(failed.unwrap_or(0))
        }
        None => {
            let b = a.r#box.context("missing box name")?;
            let s = time_travel::snapshot(reg, &b, a.name.as_deref(), a.checkpoint)?;
            nestbox_runtime::phases::report();
            if a.json {
                println!(
                    "{}",
                    serde_json::to_string(&time_travel::SnapshotInfo::from(&s))?
                );
            } else {
                println!(
                    "{} ({} files, {}; {} read, {} new objects, {} stored{}, {:.1} ms)",
                    s.name,
                    s.files,
                    human(s.bytes),
                    s.files_read,
                    s.new_objects,
                    human(s.new_bytes),
                    if s.processes {
                        "; processes checkpointed"
                    } else {
                        ""
                    },
                    s.ms
                );
            }
            Ok(0)
        }
    }
}

/// Run `rollback`.
pub fn rollback(reg: &Registry, a: RollbackArgs) -> Result<i32> {
    let r = time_travel::rollback(reg, &a.r#box, &a.snapshot, Duration::from_secs(a.time))?;
    nestbox_runtime::phases::report();
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "{} rolled back to {}{} (files swapped in {:.1} ms, {:.1} ms in all)",
            r.box_name,
            r.snapshot,
            if r.processes {
                ", its processes put back"
            } else if r.restarted {
                ", restarted"
            } else {
                ""
            },
            r.swap_ms,
            r.total_ms
        );
    }
    Ok(0)
}

/// Run `diff`.
pub fn diff(reg: &Registry, a: DiffArgs) -> Result<i32> {
    let changes = time_travel::diff(reg, &a.r#box, a.snapshot.as_deref())?;
    if a.json {
        let v: Vec<_> = changes
            .iter()
            .map(|(c, p)| json!({"kind": c.letter().to_string(), "path": format!("/{p}")}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        for (c, p) in changes {
            println!("{} /{p}", c.letter());
        }
    }
    Ok(0)
}
