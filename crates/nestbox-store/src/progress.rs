//! Progress of long operations: a bar on a terminal, nothing otherwise. The
//! caller decides whether to show it (a terminal and no `--quiet`).

use std::io::Read;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A progress reporter; all methods are cheap no-ops when hidden.
#[derive(Debug, Clone)]
pub struct Progress {
    bar: Option<ProgressBar>,
}

impl Progress {
    /// A reporter that shows nothing.
    pub fn hidden() -> Self {
        Progress { bar: None }
    }

    /// A byte-counting bar on stderr labelled `what` (shown when `visible`).
    pub fn bytes(visible: bool, what: &str, total: Option<u64>) -> Self {
        if !visible {
            return Self::hidden();
        }
        let bar = ProgressBar::with_draw_target(total, ProgressDrawTarget::stderr());
        let style = if total.is_some() {
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}"
        } else {
            "{msg} {spinner} {bytes} {bytes_per_sec} {elapsed}"
        };
        if let Ok(s) = ProgressStyle::with_template(style) {
            bar.set_style(s.progress_chars("=> "));
        }
        bar.set_message(what.to_string());
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        Progress { bar: Some(bar) }
    }

    /// Count `n` more bytes done.
    pub fn inc(&self, n: u64) {
        if let Some(b) = &self.bar {
            b.inc(n);
        }
    }

    /// Change the label.
    pub fn set_message(&self, what: &str) {
        if let Some(b) = &self.bar {
            b.set_message(what.to_string());
        }
    }

    /// Set or change the expected total.
    pub fn set_total(&self, total: u64) {
        if let Some(b) = &self.bar {
            b.set_length(total);
        }
    }

    /// Remove the bar from the terminal.
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// A reader that reports the bytes read through it.
#[derive(Debug)]
pub struct CountingReader<'p, R> {
    inner: R,
    progress: &'p Progress,
}

impl<'p, R> CountingReader<'p, R> {
    /// Count reads of `inner` into `progress`.
    pub fn new(inner: R, progress: &'p Progress) -> Self {
        CountingReader { inner, progress }
    }
}

impl<R: Read> Read for CountingReader<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.progress.inc(n as u64);
        Ok(n)
    }
}
