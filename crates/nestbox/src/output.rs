//! What the listing and reporting commands print: `ps`, `logs`, `stats`, `gc`.

use anyhow::Result;
use nestbox_runtime::registry::Registry;
use nestbox_runtime::size::format_size;
use nestbox_runtime::state::{now, Status};
use nestbox_runtime::{logs, ops};
use serde_json::json;

/// `ps`: a table, or JSON with `--json`.
pub fn ps(reg: &Registry, all: bool, as_json: bool) -> Result<()> {
    let mut rows = Vec::new();
    for r in reg.list()? {
        let status = r.state.effective_status();
        if !all && !matches!(status, Status::Running | Status::Creating) {
            continue;
        }
        rows.push(json!({
            "name": r.name(),
            "id": r.state.id,
            "status": status.as_str(),
            "exit_code": r.state.exit_code,
            "pid": r.state.init.map(|p| p.pid),
            "created": r.state.created_at,
            "command": r.spec.command.join(" "),
        }));
    }
    if as_json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "{:<20} {:<14} {:<12} {:>8} {:<12} COMMAND",
        "NAME", "ID", "STATUS", "PID", "CREATED"
    );
    for row in rows {
        let status = match (row["status"].as_str(), row["exit_code"].as_i64()) {
            (Some("exited"), Some(c)) => format!("exited ({c})"),
            (Some(s), _) => s.to_string(),
            _ => String::new(),
        };
        let pid = row["pid"]
            .as_i64()
            .map(|p| p.to_string())
            .unwrap_or_else(|| "-".into());
        let age = ago(row["created"].as_f64().unwrap_or(0.0));
        println!(
            "{:<20} {:<14} {:<12} {:>8} {:<12} {}",
            row["name"].as_str().unwrap_or(""),
            row["id"].as_str().unwrap_or(""),
            status,
            pid,
            age,
            row["command"].as_str().unwrap_or("")
        );
    }
    Ok(())
}

fn ago(t: f64) -> String {
    let s = (now() - t).max(0.0) as u64;
    match s {
        0..=59 => format!("{s}s ago"),
        60..=3599 => format!("{}m ago", s / 60),
        3600..=86399 => format!("{}h ago", s / 3600),
        _ => format!("{}d ago", s / 86400),
    }
}

/// `logs [-f]`.
pub fn logs(reg: &Registry, name: &str, follow: bool) -> Result<()> {
    let record = reg.load(name)?;
    let finished = || {
        reg.load(name)
            .map(|r| {
                !matches!(
                    r.state.effective_status(),
                    Status::Running | Status::Creating
                )
            })
            .unwrap_or(true)
    };
    logs::replay(
        &record.log_path(),
        follow,
        &finished,
        &mut std::io::stdout(),
        &mut std::io::stderr(),
    )?;
    Ok(())
}

/// `stats [--json]`.
pub fn stats(reg: &Registry, name: &str, as_json: bool) -> Result<()> {
    let s = ops::stats(reg, name)?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(());
    }
    println!(
        "{:<20} {:>12} {:>12} {:>12} {:>6}",
        "NAME", "CPU", "MEM", "MEM PEAK", "PIDS"
    );
    println!(
        "{:<20} {:>11.3}s {:>12} {:>12} {:>6}",
        name,
        s.cpu_usage_ns as f64 / 1e9,
        format_size(s.memory_current),
        format_size(s.memory_peak),
        s.pids_current
    );
    Ok(())
}

/// `gc`: say what was removed.
pub fn gc(reg: &Registry) -> Result<()> {
    let r = ops::gc(reg)?;
    for b in &r.boxes {
        println!("removed dead box {b}");
    }
    for c in &r.cgroups {
        println!("removed cgroup {c}");
    }
    for d in &r.dirs {
        println!("removed {d}");
    }
    if r.boxes.is_empty() && r.cgroups.is_empty() && r.dirs.is_empty() {
        println!("nothing to collect");
    }
    Ok(())
}
