//! Whether a recorded process is still the same process: a pid plus its start
//! time (field 22 of `/proc/PID/stat`), so a recycled pid is never mistaken for it.

use serde::{Deserialize, Serialize};

/// A process identity that survives pid reuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcRef {
    /// The pid (in the namespace of whoever recorded it).
    pub pid: i32,
    /// Start time in clock ticks after boot.
    pub start_time: u64,
}

impl ProcRef {
    /// The identity of the live process `pid`, if it exists.
    pub fn of(pid: i32) -> Option<ProcRef> {
        start_time(pid).map(|start_time| ProcRef { pid, start_time })
    }

    /// The identity of the calling process.
    pub fn current() -> ProcRef {
        Self::of(std::process::id() as i32).unwrap_or(ProcRef {
            pid: std::process::id() as i32,
            start_time: 0,
        })
    }

    /// Whether this process ends within `limit` (checked every 10 ms): after a
    /// call failed because the process was exiting, e.g. a pid namespace whose
    /// init is exiting refuses new processes with ENOMEM before the init is a
    /// zombie.
    pub fn ends_within(&self, limit: std::time::Duration) -> bool {
        let end = std::time::Instant::now() + limit;
        while self.alive() {
            if std::time::Instant::now() >= end {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        true
    }

    /// Whether this exact process is still alive (zombies count as dead).
    pub fn alive(&self) -> bool {
        match read_stat(self.pid) {
            Some(stat) => parse_stat(&stat)
                .is_some_and(|(state, st)| st == self.start_time && state != 'Z' && state != 'X'),
            None => false,
        }
    }
}

/// `/proc/PID/stat`, read with as few system calls as it takes (the file
/// reports no size, so a plain read-to-end starts with tiny reads; liveness is
/// checked on the clone-claim path).
fn read_stat(pid: i32) -> Option<String> {
    use std::io::Read;
    let mut f = std::fs::File::open(format!("/proc/{pid}/stat")).ok()?;
    let mut buf = [0u8; 1024];
    let mut len = 0;
    while len < buf.len() && !buf[..len].ends_with(b"\n") {
        match f.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    String::from_utf8(buf[..len].to_vec()).ok()
}

/// The start time of process `pid` (clock ticks since boot), if it lives.
pub(crate) fn start_time(pid: i32) -> Option<u64> {
    let stat = read_stat(pid)?;
    parse_stat(&stat).map(|(_, st)| st)
}

/// (state, start time) from a `/proc/PID/stat` line; the command name may contain
/// spaces and parentheses, so fields are counted from the last `)`.
fn parse_stat(stat: &str) -> Option<(char, u64)> {
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); start time is field 22.
    let state = fields.first()?.chars().next()?;
    Some((state, fields.get(19)?.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_process_is_alive_and_a_changed_start_is_not() {
        let me = ProcRef::current();
        assert!(me.alive());
        assert!(!ProcRef {
            start_time: me.start_time + 1,
            ..me
        }
        .alive());
        assert!(!ProcRef {
            pid: i32::MAX,
            start_time: 1
        }
        .alive());
    }

    #[test]
    fn parses_names_with_parentheses() {
        let line = "42 (a) b) c) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 98765 0 0";
        assert_eq!(parse_stat(line), Some(('S', 98765)));
    }
}
