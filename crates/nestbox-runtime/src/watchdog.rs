//! The overload watchdog (Linux-VServer's idea): when the host runs short of
//! memory, stop the box that uses the most memory above its reservation,
//! before the kernel's OOM killer picks a victim by its own rules.
//!
//! Policy, checked every interval (`nestbox watchdog`, or once with `--once`):
//! 1. If the host's `MemAvailable` is at or above the threshold
//!    (`--min-available`, by default 5 % of `MemTotal` and at least 128 MiB),
//!    nothing happens.
//! 2. Otherwise every running box of this root is a candidate, except
//!    templates (frozen: their clones depend on them) and pooled clones (not
//!    yet handed out). Each one's *excess* is its cgroup's memory use minus its
//!    reservation (`--memory-reserve`, 0 without one).
//! 3. The box with the largest positive excess is stopped at once (SIGKILL
//!    through `stop` with no grace period: under memory pressure a grace
//!    period is memory the host does not have). Its state records the
//!    decision ([`WatchdogStop`]: when, the available memory and threshold,
//!    its use and reservation), `ps` shows it as `exited (watchdog)`, and the
//!    decision is logged (`warn`). A box within its reservation is never
//!    stopped; if no box exceeds its reservation, nothing is stopped and that
//!    is logged.
//! 4. One box per check: the next check sees what the stop freed.

use std::time::Duration;

use crate::registry::Registry;
use crate::state::{Status, WatchdogStop};
use crate::{Result, RuntimeError};

/// The watchdog's settings.
#[derive(Debug, Clone, Copy)]
pub struct WatchdogConfig {
    /// Stop a box when `MemAvailable` falls below this many bytes.
    pub min_available: u64,
    /// Time between checks.
    pub interval: Duration,
}

/// The default threshold: 5 % of the host's memory, at least 128 MiB.
pub fn default_min_available(mem_total: u64) -> u64 {
    (mem_total / 20).max(128 << 20)
}

/// `MemTotal` and `MemAvailable` of `/proc/meminfo` text, in bytes.
fn parse_meminfo(text: &str) -> Option<(u64, u64)> {
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map(|kib| kib * 1024)
    };
    Some((field("MemTotal:")?, field("MemAvailable:")?))
}

/// The host's (`MemTotal`, `MemAvailable`), in bytes.
pub fn host_memory() -> Result<(u64, u64)> {
    let path = "/proc/meminfo";
    let text = std::fs::read_to_string(path).map_err(RuntimeError::io("read", path))?;
    parse_meminfo(&text).ok_or_else(|| {
        RuntimeError::InvalidInput(format!("{path}: no MemTotal or MemAvailable line"))
    })
}

/// A box the watchdog may stop, with its memory figures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// Box name.
    pub name: String,
    /// Memory in use (its cgroup's), bytes.
    pub memory: u64,
    /// Its reservation, bytes.
    pub reserve: u64,
}

impl Candidate {
    fn excess(&self) -> u64 {
        self.memory.saturating_sub(self.reserve)
    }
}

/// The box to stop: the largest use above its reservation (ties: the first
/// name), none if every box is within its reservation.
pub fn choose(candidates: &[Candidate]) -> Option<&Candidate> {
    candidates
        .iter()
        .filter(|c| c.excess() > 0)
        .max_by(|a, b| a.excess().cmp(&b.excess()).then(b.name.cmp(&a.name)))
}

/// Running boxes of `reg` that may be stopped, with their memory use.
fn candidates(reg: &Registry) -> Result<Vec<Candidate>> {
    let mut out = Vec::new();
    for r in reg.list()? {
        if r.state.effective_status() != Status::Running
            || r.state.template.is_some()
            || r.is_pooled()
            || r.is_shell()
        {
            continue;
        }
        let Some(cg) = &r.state.cgroup else { continue };
        // A box that ended since the listing has no cgroup to read: skip it.
        let Ok(stats) = cg.stats() else { continue };
        out.push(Candidate {
            name: r.name().to_string(),
            memory: stats.memory_current,
            reserve: r.spec.limits.memory_reserve.unwrap_or(0),
        });
    }
    Ok(out)
}

/// One check (see the module documentation); returns the box stopped, if any.
pub fn check_once(reg: &Registry, cfg: &WatchdogConfig) -> Result<Option<(String, WatchdogStop)>> {
    let (_, available) = host_memory()?;
    if available >= cfg.min_available {
        return Ok(None);
    }
    let all = candidates(reg)?;
    let Some(victim) = choose(&all).cloned() else {
        tracing::warn!(
            available,
            min_available = cfg.min_available,
            boxes = all.len(),
            "memory is short, but no box uses more than its reservation: nothing stopped"
        );
        return Ok(None);
    };
    let verdict = WatchdogStop {
        at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        available_bytes: available,
        min_available_bytes: cfg.min_available,
        memory_bytes: victim.memory,
        reserve_bytes: victim.reserve,
    };
    tracing::warn!(
        box_name = victim.name,
        available,
        min_available = cfg.min_available,
        memory = victim.memory,
        reserve = victim.reserve,
        "memory is short: stopping the box furthest above its reservation"
    );
    // Recorded first, so the box's end is never seen without its reason.
    reg.update(&victim.name, |s| s.watchdog = Some(verdict.clone()))?;
    crate::ops::stop(reg, &victim.name, Duration::ZERO)?;
    Ok(Some((victim.name, verdict)))
}

/// Check every `cfg.interval` until an error; each stop is passed to `on_stop`.
/// A box that vanished between the choice and the stop is not an error.
pub fn run(
    reg: &Registry,
    cfg: &WatchdogConfig,
    mut on_stop: impl FnMut(&str, &WatchdogStop),
) -> Result<()> {
    loop {
        match check_once(reg, cfg) {
            Ok(Some((name, v))) => on_stop(&name, &v),
            Ok(None) => {}
            Err(e) if e.kind() == crate::error::ErrorKind::NotFound => {
                tracing::debug!("a box went away while the watchdog looked at it: {e}");
            }
            Err(e) => return Err(e),
        }
        std::thread::sleep(cfg.interval);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(name: &str, memory: u64, reserve: u64) -> Candidate {
        Candidate {
            name: name.into(),
            memory,
            reserve,
        }
    }

    #[test]
    fn the_box_furthest_above_its_reservation_is_chosen() {
        let boxes = [
            c("big-reserved", 900, 800),
            c("hog", 500, 0),
            c("small", 50, 0),
        ];
        assert_eq!(choose(&boxes).unwrap().name, "hog");
        // Within their reservations: nobody.
        assert_eq!(choose(&[c("a", 100, 100), c("b", 10, 50)]), None);
        // Ties go to the first name.
        assert_eq!(choose(&[c("b", 100, 0), c("a", 100, 0)]).unwrap().name, "a");
    }

    #[test]
    fn meminfo_and_default_threshold() {
        let text = "MemTotal:       24000000 kB\nMemFree:  1 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(
            parse_meminfo(text),
            Some((24_000_000 * 1024, 20_000_000 * 1024))
        );
        assert_eq!(parse_meminfo("MemTotal: 1 kB\n"), None);
        assert_eq!(default_min_available(24_000_000 * 1024), 1_228_800_000);
        assert_eq!(default_min_available(1 << 30), 128 << 20);
    }
}
