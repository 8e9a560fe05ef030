//! Diagnostics: the warnings and errors of nestbox's processes, written through
//! [`tracing`] as one line each.
//!
//! A detached monitor has its stdio on `/dev/null` and `nestbox serve` often
//! too: what fails after a box was reported started would disappear. So a
//! detached monitor writes to `monitor.log` in the box's data directory
//! (`$ROOT/lib/boxes/<id>/monitor.log`, shown by `nestbox logs --monitor BOX`)
//! and `nestbox serve` to `$ROOT/run/serve.log` (and stderr); the CLI writes to
//! stderr. Only warnings and errors are recorded: every other level is disabled
//! at its call site.
//!
//! The subscriber is this module's own, and small on purpose (an idle box's
//! monitor and init are a measured ≤ 2 MiB of RSS): no thread, no buffer, no
//! span bookkeeping; the file is opened on the first line (a box with nothing
//! to report has no file and holds no descriptor) and each line is one
//! `write(2)` on an `O_APPEND` descriptor, so lines of several processes never
//! interleave. Lines read `2026-11-24T05:55:00.123Z WARN box "web": message`.

use std::fmt::{self, Write as _};
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::subscriber::Interest;
use tracing::{span, Event, Level, Metadata};

/// Where lines go.
#[derive(Debug)]
struct Destination {
    /// The log file, opened on the first line.
    path: Option<PathBuf>,
    file: Option<File>,
    /// Also (or only, without `path`) to stderr, as `nestbox: warning: …`.
    stderr: bool,
}

static DESTINATION: Mutex<Destination> = Mutex::new(Destination {
    path: None,
    file: None,
    stderr: false,
});

/// The subscriber: formats warnings and errors and writes them to [`DESTINATION`].
#[derive(Debug, Clone, Copy)]
struct Diag;

/// Install the subscriber for this process, if it has none. The state set by
/// the functions below is per process (a forked child inherits a copy).
fn install() {
    if tracing::dispatcher::has_been_set() {
        return;
    }
    // An error means another subscriber (of an embedding program or a test
    // harness) was set meanwhile; it then receives the events instead.
    if let Err(e) = tracing::subscriber::set_global_default(Diag) {
        eprintln!("nestbox: warning: diagnostics go to another subscriber: {e}");
    }
}

fn destination() -> std::sync::MutexGuard<'static, Destination> {
    // A poisoned lock only means a thread panicked while writing a line: the
    // destination itself is still whole.
    DESTINATION.lock().unwrap_or_else(|p| p.into_inner())
}

/// Warnings and errors go to stderr (the CLI).
pub fn to_stderr() {
    install();
    let mut d = destination();
    *d = Destination {
        path: None,
        file: None,
        stderr: true,
    };
}

/// Warnings and errors go to the file `path` (created 0600 on the first line),
/// and to stderr as well with `also_stderr`.
pub fn to_file(path: PathBuf, also_stderr: bool) {
    install();
    let mut d = destination();
    *d = Destination {
        path: Some(path),
        file: None,
        stderr: also_stderr,
    };
}

/// Warnings and errors go to the file `path` (and to stderr when they went
/// there) until the returned guard is dropped, which puts the destination
/// back. A process forked meanwhile keeps writing to `path`: a lazy
/// restore's page server logs to the restored box's monitor log.
pub fn file_for_now(path: PathBuf) -> FileForNow {
    install();
    let mut d = destination();
    let before = FileForNow {
        path: d.path.take(),
        stderr: d.stderr,
    };
    d.file = None;
    d.path = Some(path);
    before
}

/// What [`file_for_now`] puts back when dropped.
#[derive(Debug)]
pub struct FileForNow {
    path: Option<PathBuf>,
    stderr: bool,
}

impl Drop for FileForNow {
    fn drop(&mut self) {
        let mut d = destination();
        d.file = None;
        d.path = self.path.take();
        d.stderr = self.stderr;
    }
}

/// Nothing is written any more: for a process that leaves nestbox's mount
/// namespace or whose descriptors are not its own (a box's first process, an
/// `exec` helper), where the log's path or descriptor would mean something else.
pub fn off() {
    let mut d = destination();
    if let Some(f) = d.file.take() {
        // Not closed: the descriptor may already be closed (or reused) by
        // the caller's own descriptor cleanup.
        std::mem::forget(f);
    }
    d.path = None;
    d.stderr = false;
}

/// Descriptors from 3 up were closed by the caller: the log file is opened
/// again on the next line.
pub fn descriptors_closed() {
    if let Some(f) = destination().file.take() {
        // Already closed by the caller: closing it again could close a
        // descriptor opened since under the same number.
        std::mem::forget(f);
    }
}

/// Report `result`'s error, if any, as a warning that `what` failed (for box
/// `box_name`): for the steps of a teardown or a cleanup that go on regardless.
pub fn warn_on_err<T, E: fmt::Display>(box_name: Option<&str>, what: &str, result: Result<T, E>) {
    if let Err(e) = result {
        tracing::warn!(box_name, "{what}: {e}");
    }
}

impl tracing::Subscriber for Diag {
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        if self.enabled(meta) {
            Interest::always()
        } else {
            Interest::never()
        }
    }
    fn enabled(&self, meta: &Metadata<'_>) -> bool {
        *meta.level() <= Level::WARN
    }
    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::WARN)
    }
    fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
        span::Id::from_u64(1)
    }
    fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
    fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let level = *event.metadata().level();
        let mut d = destination();
        if d.stderr {
            let word = if level == Level::ERROR {
                "error"
            } else {
                "warning"
            };
            let line = format!("nestbox: {word}: {}\n", fields.text());
            // Nowhere else to report a failure to write to stderr.
            let _ = std::io::stderr().write_all(line.as_bytes());
        }
        if d.file.is_none() {
            if let Some(path) = &d.path {
                d.file = OpenOptions::new()
                    .append(true)
                    .create(true)
                    .mode(0o600)
                    .custom_flags(libc::O_CLOEXEC)
                    .open(path)
                    .ok();
            }
        }
        if let Some(f) = &mut d.file {
            let line = format!(
                "{} {level} {}\n",
                timestamp(SystemTime::now()),
                fields.text()
            );
            // A log that cannot be written has nowhere to report that.
            let _ = f.write_all(line.as_bytes());
        }
    }
    fn enter(&self, _: &span::Id) {}
    fn exit(&self, _: &span::Id) {}
}

/// An event's fields: `box_name` and the message first, the others after.
#[derive(Debug, Default)]
struct Fields {
    box_name: Option<String>,
    message: String,
    rest: String,
}

impl Fields {
    fn text(&self) -> String {
        let mut s = String::new();
        if let Some(b) = &self.box_name {
            // Infallible: writing to a String.
            let _ = write!(s, "box {b:?}: ");
        }
        s.push_str(&self.message);
        s.push_str(&self.rest);
        s.replace('\n', " ")
    }
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "box_name" => self.box_name = Some(value.to_string()),
            "message" => self.message.push_str(value),
            name => {
                // Infallible: writing to a String.
                let _ = write!(self.rest, " {name}={value:?}");
            }
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        match field.name() {
            // Infallible: writing to a String.
            "message" => drop(write!(self.message, "{value:?}")),
            "box_name" => self.box_name = Some(format!("{value:?}").trim_matches('"').to_string()),
            name => drop(write!(self.rest, " {name}={value:?}")),
        }
    }
}

/// `t` as UTC, `YYYY-MM-DDTHH:MM:SS.mmmZ`.
fn timestamp(t: SystemTime) -> String {
    rfc3339(t, false)
}

/// `t` as UTC RFC 3339, `YYYY-MM-DDTHH:MM:SS.fffZ` with milliseconds, or
/// nanoseconds when `nanos` (as runc writes a container's creation time).
pub fn rfc3339(t: SystemTime, nanos: bool) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let fraction = if nanos {
        format!("{:09}", d.subsec_nanos())
    } else {
        format!("{:03}", d.subsec_millis())
    };
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{fraction}Z",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn timestamps_are_utc_civil_dates() {
        let t = UNIX_EPOCH + Duration::from_millis(1_795_499_700_123);
        assert_eq!(timestamp(t), "2026-11-24T05:55:00.123Z");
        assert_eq!(timestamp(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(timestamp(leap), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn warnings_and_errors_reach_the_file_with_their_box() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("monitor.log");
        to_file(path.clone(), false);
        tracing::info!(box_name = "diag-web", "not recorded");
        assert!(!path.exists(), "an info line opens no file");
        tracing::warn!(box_name = "diag-web", code = 3, "releasing: {}", "gone");
        tracing::error!("diag: no box here");
        off();
        tracing::error!("diag: after off");
        let text = std::fs::read_to_string(&path).unwrap();
        // Other tests of this process may log meanwhile: only this test's lines.
        let lines: Vec<&str> = text.lines().filter(|l| l.contains("diag")).collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(
            lines[0].ends_with(" WARN box \"diag-web\": releasing: gone code=3"),
            "{text}"
        );
        assert!(lines[1].ends_with(" ERROR diag: no box here"), "{text}");
    }
}
