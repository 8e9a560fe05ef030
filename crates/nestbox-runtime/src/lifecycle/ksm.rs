//! Same-page merging (KSM) of boxes' memory: marking a box's processes
//! mergeable, what each box gains from it, and the host-wide scanner.
//!
//! `nestbox run --ksm` makes the box's command call `prctl(PR_SET_MEMORY_MERGE)`
//! before it execs: the kernel then treats all of its anonymous memory as
//! mergeable, and the mark is kept across `execve` and inherited by every
//! process it forks, so the whole box is covered, and so are clones of it (a
//! clone is a fork of the template's processes). `nestbox exec` into such a box
//! marks its command the same way. Merging is done by the kernel's `ksmd`
//! thread, which scans mergeable memory only while `/sys/kernel/mm/ksm/run` is
//! 1; nestbox does not turn it on by itself (it is a setting of the whole
//! host): `nestbox ksm --on` does, and `--pages-to-scan`/`--sleep-ms` tune it.
//!
//! Figures: per box, the sum over its processes of `/proc/PID/ksm_stat`
//! (`ksm_merging_pages`: pages of the box backed by a merged page,
//! `ksm_process_profit`: what merging saves it, net of the scanner's
//! bookkeeping); per host, `/sys/kernel/mm/ksm/*` and the CPU time of `ksmd`
//! (its cost).

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::{Result, RuntimeError};

/// Where the kernel's KSM settings and counters are.
pub const SYSFS: &str = "/sys/kernel/mm/ksm";

/// `PR_SET_MEMORY_MERGE` (Linux 6.4).
const PR_SET_MEMORY_MERGE: libc::c_int = 67;

/// Mark this process's anonymous memory mergeable (kept across `execve`,
/// inherited by children). Called by a box's command before it execs.
pub fn make_process_mergeable() -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments only; PR_SET_MEMORY_MERGE changes a
    // flag of this process's memory map and reads no memory of ours.
    let rc = unsafe { libc::prctl(PR_SET_MEMORY_MERGE, 1 as libc::c_ulong, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// What merging gives one box (the sum over its processes).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct BoxKsm {
    /// Processes whose memory is marked mergeable as a whole.
    pub mergeable_processes: u64,
    /// Pages of the box's memory backed by a page merged with others.
    pub merging_pages: u64,
    /// Bytes merging saves the box, net of the scanner's bookkeeping (may be
    /// negative while nothing is merged yet).
    pub profit_bytes: i64,
}

/// Parse one process's `/proc/PID/ksm_stat` into `total`.
fn add_ksm_stat(total: &mut BoxKsm, text: &str) {
    for line in text.lines() {
        let mut f = line.split_whitespace();
        match (f.next(), f.next()) {
            (Some("ksm_merging_pages"), Some(v)) => {
                total.merging_pages += v.parse::<u64>().unwrap_or(0)
            }
            (Some("ksm_process_profit"), Some(v)) => {
                total.profit_bytes += v.parse::<i64>().unwrap_or(0)
            }
            (Some("ksm_merge_any:"), Some("yes")) => total.mergeable_processes += 1,
            _ => {}
        }
    }
}

/// The KSM figures of the processes `pids` (host pids; a process that ended
/// meanwhile is left out).
pub fn of_processes(pids: &[i32]) -> BoxKsm {
    let mut total = BoxKsm::default();
    for pid in pids {
        if let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/ksm_stat")) {
            add_ksm_stat(&mut total, &text);
        }
    }
    total
}

/// The host's scanner: its settings, what it has merged, and its CPU time.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct HostKsm {
    /// Whether `ksmd` scans (`run` = 1).
    pub running: bool,
    /// Pages scanned per wake-up.
    pub pages_to_scan: u64,
    /// Sleep between wake-ups, in milliseconds.
    pub sleep_millisecs: u64,
    /// Merged pages in use (each stands for several).
    pub pages_shared: u64,
    /// Pages of processes backed by a merged page ("how much is saved").
    pub pages_sharing: u64,
    /// Pages scanned that are unique so far.
    pub pages_unshared: u64,
    /// Pages changing too fast to be merged.
    pub pages_volatile: u64,
    /// Full scans of all mergeable memory so far.
    pub full_scans: u64,
    /// Bytes saved host-wide, net of bookkeeping.
    pub general_profit_bytes: i64,
    /// CPU time `ksmd` has used since boot (user + system), in milliseconds.
    pub ksmd_cpu_ms: u64,
}

fn read_number(dir: &Path, name: &str) -> Result<i64> {
    let path = dir.join(name);
    let text = std::fs::read_to_string(&path).map_err(RuntimeError::io("read", &path))?;
    text.trim().parse().map_err(|_| {
        RuntimeError::InvalidInput(format!(
            "{}: expected a number, found {:?}",
            path.display(),
            text.trim()
        ))
    })
}

/// The scanner's state, read from `dir` (normally [`SYSFS`]).
pub fn host(dir: &Path) -> Result<HostKsm> {
    let n = |name: &str| read_number(dir, name).map(|v| v.max(0) as u64);
    Ok(HostKsm {
        running: n("run")? == 1,
        pages_to_scan: n("pages_to_scan")?,
        sleep_millisecs: n("sleep_millisecs")?,
        pages_shared: n("pages_shared")?,
        pages_sharing: n("pages_sharing")?,
        pages_unshared: n("pages_unshared")?,
        pages_volatile: n("pages_volatile")?,
        full_scans: n("full_scans")?,
        // Absent before Linux 6.1.
        general_profit_bytes: read_number(dir, "general_profit").unwrap_or(0),
        ksmd_cpu_ms: ksmd_cpu_ms(),
    })
}

/// CPU time of the `ksmd` kernel thread, in milliseconds (0 if not found).
fn ksmd_cpu_ms() -> u64 {
    // SAFETY: sysconf with a valid name reads a constant.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    crate::process::proc_pid_dirs()
        .find(|dir| std::fs::read_to_string(dir.join("comm")).is_ok_and(|c| c.trim() == "ksmd"))
        .and_then(|dir| std::fs::read_to_string(dir.join("stat")).ok())
        .and_then(|stat| cpu_ticks_of_stat(&stat))
        .map_or(0, |t| t * 1000 / ticks)
}

/// utime + stime (clock ticks) of a `/proc/PID/stat` line.
fn cpu_ticks_of_stat(stat: &str) -> Option<u64> {
    // Fields after the command name in parentheses: state is field 3, utime 14.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// New scanner settings (`None`: unchanged).
#[derive(Debug, Clone, Copy, Default)]
pub struct Tuning {
    /// Start (`true`) or stop (`false`, merged pages stay merged) the scanner.
    pub run: Option<bool>,
    /// Pages scanned per wake-up (1 to 100000).
    pub pages_to_scan: Option<u64>,
    /// Sleep between wake-ups in milliseconds (0 to 10000).
    pub sleep_millisecs: Option<u64>,
}

/// Apply `t` to the scanner in `dir` (normally [`SYSFS`]); every value is
/// checked before anything is written.
pub fn tune(dir: &Path, t: Tuning) -> Result<()> {
    if let Some(p) = t.pages_to_scan.filter(|p| !(1..=100_000).contains(p)) {
        return Err(RuntimeError::InvalidInput(format!(
            "invalid --pages-to-scan {p}: expected 1 to 100000"
        )));
    }
    if let Some(s) = t.sleep_millisecs.filter(|s| *s > 10_000) {
        return Err(RuntimeError::InvalidInput(format!(
            "invalid --sleep-ms {s}: expected 0 to 10000"
        )));
    }
    let write = |name: &str, value: u64| -> Result<()> {
        let path: PathBuf = dir.join(name);
        std::fs::write(&path, value.to_string()).map_err(RuntimeError::io("write", &path))
    };
    if let Some(p) = t.pages_to_scan {
        write("pages_to_scan", p)?;
    }
    if let Some(s) = t.sleep_millisecs {
        write("sleep_millisecs", s)?;
    }
    if let Some(run) = t.run {
        write("run", u64::from(run))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ksm_stat_of_processes_adds_up() {
        let mut total = BoxKsm::default();
        add_ksm_stat(
            &mut total,
            "ksm_rmap_items 12850\nksm_zero_pages 0\nksm_merging_pages 12800\n\
             ksm_process_profit 51608576\nksm_merge_any: yes\nksm_mergeable: yes\n",
        );
        add_ksm_stat(
            &mut total,
            "ksm_rmap_items 0\nksm_zero_pages 0\nksm_merging_pages 0\n\
             ksm_process_profit -4096\nksm_merge_any: no\nksm_mergeable: no\n",
        );
        assert_eq!(
            total,
            BoxKsm {
                mergeable_processes: 1,
                merging_pages: 12800,
                profit_bytes: 51608576 - 4096,
            }
        );
    }

    #[test]
    fn cpu_time_of_a_stat_line() {
        let stat = "37 (ksmd) S 2 0 0 0 -1 2129984 0 0 0 0 150 25 0 0 25 5 1 0 10 0 0";
        assert_eq!(cpu_ticks_of_stat(stat), Some(175));
        assert_eq!(cpu_ticks_of_stat("37 (ksmd) S 2"), None);
    }

    /// A fake sysfs directory: reading and tuning, and bad values refused
    /// before anything is written.
    #[test]
    fn host_figures_and_tuning_on_a_fake_sysfs() {
        let dir = tempfile::tempdir().unwrap();
        for (name, v) in [
            ("run", "0"),
            ("pages_to_scan", "100"),
            ("sleep_millisecs", "20"),
            ("pages_shared", "10"),
            ("pages_sharing", "90"),
            ("pages_unshared", "5"),
            ("pages_volatile", "1"),
            ("full_scans", "3"),
            ("general_profit", "-8192"),
        ] {
            std::fs::write(dir.path().join(name), format!("{v}\n")).unwrap();
        }
        let h = host(dir.path()).unwrap();
        assert!(!h.running);
        assert_eq!((h.pages_shared, h.pages_sharing, h.full_scans), (10, 90, 3));
        assert_eq!(h.general_profit_bytes, -8192);
        let err = tune(
            dir.path(),
            Tuning {
                run: Some(true),
                pages_to_scan: Some(0),
                sleep_millisecs: None,
            },
        )
        .unwrap_err();
        assert!(err.to_string().contains("--pages-to-scan 0"), "{err}");
        assert!(!host(dir.path()).unwrap().running, "nothing written");
        tune(
            dir.path(),
            Tuning {
                run: Some(true),
                pages_to_scan: Some(5000),
                sleep_millisecs: Some(0),
            },
        )
        .unwrap();
        let h = host(dir.path()).unwrap();
        assert!(h.running);
        assert_eq!((h.pages_to_scan, h.sleep_millisecs), (5000, 0));
    }
}
