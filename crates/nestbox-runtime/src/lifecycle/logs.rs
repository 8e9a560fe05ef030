//! A box's output log: the monitor appends every chunk the command writes to
//! stdout or stderr as a framed record (1 byte stream, 4 bytes little-endian
//! length, data), so `logs` can replay both streams in the order they were written
//! and `logs -f` can follow a running box.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::Duration;

use crate::{Result, RuntimeError};

/// Which output stream a record came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout = 1,
    /// Standard error.
    Stderr = 2,
}

const HEADER: usize = 5;

/// Appends records to a log file.
#[derive(Debug)]
pub struct LogWriter {
    file: File,
}

impl LogWriter {
    /// Open (creating) the log at `path` for appending.
    pub fn open(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(RuntimeError::io("open log", path))?;
        Ok(LogWriter { file })
    }

    /// Append one record (one write, so a reader never sees a torn header).
    pub fn append(&mut self, stream: Stream, data: &[u8]) -> std::io::Result<()> {
        let mut rec = Vec::with_capacity(HEADER + data.len());
        rec.push(stream as u8);
        rec.extend_from_slice(&(data.len() as u32).to_le_bytes());
        rec.extend_from_slice(data);
        self.file.write_all(&rec)
    }
}

/// Reads records from a log, tolerating a record still being written at the end.
#[derive(Debug)]
pub struct LogReader {
    file: File,
    pos: u64,
}

impl LogReader {
    /// Open the log at `path`; a missing log reads as empty.
    pub fn open(path: &Path) -> Result<Option<Self>> {
        match File::open(path) {
            Ok(file) => Ok(Some(LogReader { file, pos: 0 })),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(RuntimeError::io("open log", path)(e)),
        }
    }

    /// The next complete record, or `None` at the (current) end.
    pub fn next_record(&mut self) -> std::io::Result<Option<(Stream, Vec<u8>)>> {
        self.file.seek(SeekFrom::Start(self.pos))?;
        let mut header = [0u8; HEADER];
        if read_full(&mut self.file, &mut header)? < HEADER {
            return Ok(None);
        }
        let len = u32::from_le_bytes([header[1], header[2], header[3], header[4]]) as usize;
        let mut data = vec![0u8; len];
        if read_full(&mut self.file, &mut data)? < len {
            return Ok(None);
        }
        self.pos += (HEADER + len) as u64;
        let stream = if header[0] == Stream::Stderr as u8 {
            Stream::Stderr
        } else {
            Stream::Stdout
        };
        Ok(Some((stream, data)))
    }
}

fn read_full(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Copy a log to `out`/`err`. With `follow`, keep reading new records until
/// `finished()` says the box has ended (then drain what is left).
pub fn replay(
    path: &Path,
    follow: bool,
    finished: &dyn Fn() -> bool,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<()> {
    let io = |e| RuntimeError::io("read log", path)(e);
    let mut reader = None;
    loop {
        if reader.is_none() {
            reader = LogReader::open(path)?;
        }
        let ended = finished();
        if let Some(r) = reader.as_mut() {
            while let Some((stream, data)) = r.next_record().map_err(io)? {
                let w: &mut dyn Write = if stream == Stream::Stderr { err } else { out };
                // A closed reader (e.g. `logs | head`) ends the replay quietly.
                if w.write_all(&data).and_then(|_| w.flush()).is_err() {
                    return Ok(());
                }
            }
        }
        if !follow || ended {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_replay_in_order_per_stream() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("log");
        let mut w = LogWriter::open(&p).unwrap();
        w.append(Stream::Stdout, b"one\n").unwrap();
        w.append(Stream::Stderr, b"oops\n").unwrap();
        w.append(Stream::Stdout, b"two\n").unwrap();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        replay(&p, false, &|| true, &mut out, &mut err).unwrap();
        assert_eq!(out, b"one\ntwo\n");
        assert_eq!(err, b"oops\n");
    }

    #[test]
    fn torn_record_is_not_returned_until_complete() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("log");
        let mut f = File::create(&p).unwrap();
        f.write_all(&[1, 4, 0, 0, 0, b'a', b'b']).unwrap();
        let mut r = LogReader::open(&p).unwrap().unwrap();
        assert!(r.next_record().unwrap().is_none());
        f.write_all(b"cd").unwrap();
        assert_eq!(r.next_record().unwrap().unwrap().1, b"abcd");
    }
}
