//! What the listing and reporting commands print: `ps`, `logs`, `stats`, `gc`.

use anyhow::Result;
use nestbox_runtime::registry::Registry;
use nestbox_runtime::size::format_size;
use nestbox_runtime::state::{now, Status};
use nestbox_runtime::{logs, ops, RuntimeError};
use serde_json::json;
use std::io::Write as _;

/// `ps`: a table, or JSON with `--json`.
pub fn ps(reg: &Registry, all: bool, as_json: bool, tree: bool) -> Result<()> {
    let mut rows = Vec::new();
    for r in reg.list()? {
        let status = r.state.effective_status();
        if !all && !matches!(status, Status::Running | Status::Creating | Status::Frozen) {
            continue;
        }
        if r.is_pooled() || r.is_shell() {
            // Part of its template's pool (see `template ls`) or of the pool
            // of box shells (see `pool ls`), not a box of its own yet.
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
            "stopped_by_watchdog": r.state.watchdog.is_some(),
        }));
        if tree {
            // The boxes inside a running nest box, as `parent/child`.
            for b in nestbox_runtime::nest::tree(&r) {
                if !all
                    && !matches!(
                        b.status,
                        Status::Running | Status::Creating | Status::Frozen
                    )
                {
                    continue;
                }
                rows.push(json!({
                    "name": b.path,
                    "id": b.id,
                    "status": b.status.as_str(),
                    "exit_code": b.exit_code,
                    "pid": b.pid,
                    "created": b.created,
                    "command": b.command,
                    "stopped_by_watchdog": false,
                }));
            }
        }
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
            (Some("exited"), Some(c)) if row["stopped_by_watchdog"] == true => {
                format!("exited ({c}, watchdog)")
            }
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
                    Status::Running | Status::Creating | Status::Frozen
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

/// `logs --monitor`: the detached monitor's warnings and errors, if it wrote any.
pub fn monitor_log(reg: &Registry, name: &str) -> Result<()> {
    let record = reg.load(name)?;
    let path = record.monitor_log_path();
    match std::fs::read(&path) {
        Ok(text) => std::io::stdout().write_all(&text)?,
        // Nothing to report: the monitor opens its log on its first line.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(RuntimeError::io("read", &path)(e).into()),
    }
    Ok(())
}

/// `stats [--json]`.
pub fn stats(reg: &Registry, name: &str, as_json: bool) -> Result<()> {
    let s = ops::stats(reg, name)?;
    // A box removed since its stats were read has no sharing figures to show.
    let sharing = reg
        .load(name)
        .ok()
        .and_then(|r| nestbox_runtime::clone::sharing(reg, &r));
    let ksm = ops::ksm(reg, name).ok().flatten();
    let disk = reg
        .load(name)
        .ok()
        .and_then(|r| nestbox_runtime::disk::usage(r.lib_dir()));
    if as_json {
        let mut v = serde_json::to_value(&s)?;
        if let Some(sh) = sharing {
            v["sharing"] = sh;
        }
        if let Some(k) = &ksm {
            v["ksm"] = serde_json::to_value(k)?;
        }
        if let Some(d) = &disk {
            v["disk"] = serde_json::to_value(d)?;
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
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
    if let Some(d) = disk {
        println!(
            "disk: {} used of {}",
            format_size(d.used_bytes),
            format_size(d.limit_bytes)
        );
    }
    if let Some(k) = ksm.filter(|k| k.mergeable_processes > 0 || k.merging_pages > 0) {
        println!(
            "ksm: {} pages merged, {} saved (net)",
            k.merging_pages,
            if k.profit_bytes < 0 {
                format!("-{}", format_size(k.profit_bytes.unsigned_abs()))
            } else {
                format_size(k.profit_bytes as u64)
            }
        );
    }
    if let Some(sh) = sharing {
        let bytes = |v: &serde_json::Value| format_size(v.as_u64().unwrap_or(0));
        match sh["role"].as_str() {
            Some("clone") => println!(
                "clone of {}: private {}, shared with the template {}",
                sh["template"].as_str().unwrap_or("?"),
                bytes(&sh["private_bytes"]),
                bytes(&sh["shared_with_template_bytes"])
            ),
            _ => println!(
                "template with {} clones: resident {} in all, proportional {}, sharing ratio {:.2}",
                sh["clones"],
                bytes(&sh["total_rss_bytes"]),
                bytes(&sh["total_pss_bytes"]),
                sh["sharing_ratio"].as_f64().unwrap_or(1.0)
            ),
        }
    }
    Ok(())
}

/// `ksm [--json]`: the host's same-page merging.
pub fn ksm(h: &nestbox_runtime::ksm::HostKsm, as_json: bool) -> Result<()> {
    if as_json {
        println!("{}", serde_json::to_string_pretty(h)?);
        return Ok(());
    }
    let pages = |n: u64| format_size(n * 4096);
    println!(
        "scanner: {} ({} pages every {} ms), {} full scans, ksmd CPU time {:.3}s",
        if h.running { "running" } else { "stopped" },
        h.pages_to_scan,
        h.sleep_millisecs,
        h.full_scans,
        h.ksmd_cpu_ms as f64 / 1e3
    );
    println!(
        "merged: {} pages stand for {} ({} saved), {} unique so far, {} changing too fast",
        h.pages_shared,
        h.pages_sharing,
        pages(h.pages_sharing),
        h.pages_unshared,
        h.pages_volatile
    );
    Ok(())
}

/// `template ls [--json]`.
pub fn templates(reg: &Registry, as_json: bool) -> Result<()> {
    let list = nestbox_runtime::template::list(reg)?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(());
    }
    println!(
        "{:<24} {:<24} {:>8} {:>7} {:>5}",
        "TEMPLATE", "BOX", "PID", "CLONES", "POOL"
    );
    for t in list {
        let clones = if t.removed {
            format!("{} (removed)", t.clones)
        } else {
            t.clones.to_string()
        };
        println!(
            "{:<24} {:<24} {:>8} {:>7} {:>5}",
            t.name, t.box_name, t.pid, clones, t.pooled
        );
    }
    Ok(())
}

/// Follow a box's output until it ends; its exit code.
pub fn follow_to_end(reg: &Registry, name: &str) -> Result<i32> {
    logs(reg, name, true)?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let record = reg.load(name)?;
        match record.state.effective_status() {
            Status::Exited => return Ok(record.state.exit_code.unwrap_or(0)),
            Status::Dead => return Ok(125),
            _ if std::time::Instant::now() > deadline => return Ok(125),
            _ => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    }
}

/// `gc`: say what was removed.
pub fn gc(reg: &Registry, root: &Option<std::path::PathBuf>) -> Result<()> {
    let r = ops::gc(reg)?;
    // Services whose supervisor died: their replicas are made anew under a
    // new supervisor.
    let revived = nestbox_runtime::service::orphaned(reg)?;
    for name in &revived {
        crate::service_cmd::start_supervisor(root, name)?;
        nestbox_runtime::service::wait_ready(reg.roots(), name, None)?;
        println!("restarted the supervisor of service {name} (its replicas made anew)");
    }
    let (dirs, packs, bytes) = nestbox_runtime::checkpoint::gc(reg)?;
    if dirs > 0 {
        println!("removed {dirs} unfinished checkpoint(s)");
    }
    if packs > 0 {
        println!(
            "removed {packs} page pack(s) no checkpoint refers to ({})",
            nestbox_runtime::size::format_size(bytes)
        );
    }
    for b in &r.boxes {
        println!("removed dead box {b}");
    }
    for c in &r.cgroups {
        println!("removed cgroup {c}");
    }
    for d in &r.dirs {
        println!("removed {d}");
    }
    for n in &r.network {
        println!("released the network of box id {n}");
    }
    for line in &r.nested {
        println!("{line}");
    }
    // After the checkpoints' gc, which thawed a nest box a killed save left
    // frozen: the boxes such a save left suspended inside it run again.
    let resumed = nestbox_runtime::subtree::resume_left_suspended(reg)?;
    for line in &resumed {
        println!("{line}");
    }
    if r.boxes.is_empty()
        && r.cgroups.is_empty()
        && r.dirs.is_empty()
        && r.network.is_empty()
        && r.nested.is_empty()
        && dirs == 0
        && packs == 0
        && revived.is_empty()
        && resumed.is_empty()
    {
        println!("nothing to collect");
    }
    Ok(())
}

/// A checkpoint without its processes' registers and memory map: what
/// `checkpoint inspect` and `checkpoint --json` show.
pub fn checkpoint_summary(
    c: &nestbox_runtime::checkpoint::Checkpoint,
    dir: Option<&std::path::Path>,
) -> serde_json::Value {
    serde_json::json!({
        "name": c.name,
        "box": c.box_name,
        "created_at": c.created_at,
        "image": c.spec.image,
        "layers": c.layers,
        "kernel": c.kernel,
        "dir": dir.map(|d| d.display().to_string()),
        "stats": c.stats,
        "processes": c.processes.iter().map(|p| serde_json::json!({
            "pid": p.ns_pid,
            "exe": p.layout.exe,
            "threads": 1 + p.threads.len(),
            "mappings": p.layout.vmas.len(),
            "fds": p.fds.iter().map(|f| serde_json::json!({
                "fd": f.fd, "target": f.target, "action": f.action().to_string(),
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "spec": {
            "image": c.spec.image,
            "command": c.spec.command,
            "network": c.spec.network,
            "limits": c.spec.limits,
        },
    })
}

/// `checkpoint ls`.
pub fn checkpoints(list: &[nestbox_runtime::checkpoint::Checkpoint], json: bool) -> Result<()> {
    if json {
        let v: Vec<serde_json::Value> = list.iter().map(|c| checkpoint_summary(c, None)).collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{:<24} {:<16} {:>8} {:>10}  COMMAND",
        "NAME", "BOX", "PAGES", "MEMORY"
    );
    for c in list {
        println!(
            "{:<24} {:<16} {:>8} {:>10}  {}",
            c.name,
            c.box_name,
            c.stats.pages,
            nestbox_runtime::size::format_size(c.stats.pages * 4096),
            c.spec.command.join(" ")
        );
    }
    Ok(())
}
