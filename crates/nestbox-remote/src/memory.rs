//! The tracee's memory: read and write it from the tracer with
//! `process_vm_readv`/`process_vm_writev`, and a scratch area mapped into it by an
//! injected `mmap` to hold the arguments of injected syscalls (paths, socket
//! addresses, message headers, capability sets).

use std::io::{self, IoSlice, IoSliceMut};

use nix::sys::uio::{process_vm_readv, process_vm_writev, RemoteIoVec};
use nix::unistd::Pid;

use crate::error::{RemoteError, Result};
use crate::tracee::Tracee;

/// Size of the scratch mapping.
pub(crate) const SCRATCH_LEN: usize = 64 * 1024;

impl Tracee {
    /// Read `buf.len()` bytes at `addr` in the tracee.
    pub fn read_mem(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        let want = buf.len();
        let remote = [RemoteIoVec {
            base: addr as usize,
            len: want,
        }];
        let n = process_vm_readv(
            Pid::from_raw(self.pid()),
            &mut [IoSliceMut::new(buf)],
            &remote,
        );
        self.transferred("process_vm_readv", n, want)
    }

    /// Write `data` at `addr` in the tracee.
    pub fn write_mem(&self, addr: u64, data: &[u8]) -> Result<()> {
        let remote = [RemoteIoVec {
            base: addr as usize,
            len: data.len(),
        }];
        let n = process_vm_writev(Pid::from_raw(self.pid()), &[IoSlice::new(data)], &remote);
        self.transferred("process_vm_writev", n, data.len())
    }

    fn transferred(&self, op: &'static str, n: nix::Result<usize>, want: usize) -> Result<()> {
        let n = n.map_err(|e| RemoteError::Sys {
            op,
            pid: self.pid(),
            source: e.into(),
        })?;
        if n != want {
            return Err(RemoteError::Sys {
                op,
                pid: self.pid(),
                source: io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("transferred {n} of {want} bytes"),
                ),
            });
        }
        Ok(())
    }
}

/// An anonymous read-write mapping in a tracee, filled from the start by
/// [`Scratch::put`] and emptied with [`Scratch::reset`].
#[derive(Debug)]
pub(crate) struct Scratch {
    pub addr: u64,
    used: usize,
}

impl Scratch {
    /// `mmap` a fresh scratch area in the tracee.
    pub fn map(tracee: &mut Tracee) -> Result<Scratch> {
        let addr = tracee.syscall(
            "mmap",
            || "scratch area".into(),
            libc::SYS_mmap,
            &[
                0,
                SCRATCH_LEN as u64,
                // Executable too: it holds the program of injected batches
                // (batch.rs). It is unmapped before any clone runs.
                (libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC) as u64,
                (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64,
                u64::MAX,
                0,
            ],
        )?;
        Ok(Scratch { addr, used: 0 })
    }

    /// The same area as seen by a process forked from the one that mapped it.
    pub fn inherited(&self) -> Scratch {
        Scratch {
            addr: self.addr,
            used: 0,
        }
    }

    /// `munmap` the area in `tracee`.
    pub fn unmap(&self, tracee: &mut Tracee) -> Result<()> {
        tracee.syscall(
            "munmap",
            || "scratch area".into(),
            libc::SYS_munmap,
            &[self.addr, SCRATCH_LEN as u64],
        )?;
        Ok(())
    }

    /// Forget everything put so far.
    pub fn reset(&mut self) {
        self.used = 0;
    }

    /// How much is in use: a mark to [`Scratch::rewind`] to.
    pub fn mark(&self) -> usize {
        self.used
    }

    /// Forget what was put since `mark`.
    pub fn rewind(&mut self, mark: usize) {
        self.used = self.used.min(mark);
    }

    /// Bytes still free.
    pub fn free(&self) -> usize {
        SCRATCH_LEN.saturating_sub(self.used.next_multiple_of(8))
    }

    /// Reserve `len` bytes (8-aligned) and return their address in the tracee.
    pub fn reserve(&mut self, len: usize) -> Result<u64> {
        let start = self.used.next_multiple_of(8);
        if start + len > SCRATCH_LEN {
            return Err(RemoteError::Plan(format!(
                "injected call arguments need more than {SCRATCH_LEN} bytes of scratch"
            )));
        }
        self.used = start + len;
        Ok(self.addr + start as u64)
    }

    /// Copy `data` into the tracee and return its address there.
    pub fn put(&mut self, tracee: &Tracee, data: &[u8]) -> Result<u64> {
        let addr = self.reserve(data.len())?;
        tracee.write_mem(addr, data)?;
        Ok(addr)
    }

    /// Copy a path (NUL-terminated) into the tracee.
    pub fn put_path(&mut self, tracee: &Tracee, path: &[u8]) -> Result<u64> {
        let mut bytes = Vec::with_capacity(path.len() + 1);
        bytes.extend_from_slice(path);
        bytes.push(0);
        self.put(tracee, &bytes)
    }
}
