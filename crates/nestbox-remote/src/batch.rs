//! Running a sequence of syscalls in a stopped tracee in one resume.
//!
//! Each injected syscall of [`Tracee::syscall`] costs a ptrace round trip (set
//! the registers, single-step, wait, read them back): some 20–50 µs on a busy
//! machine. Steps that make many calls in a row (joining seven namespaces,
//! dropping thirty capabilities from the bounding set) instead write a table of
//! calls and a 58-byte program into the scratch area and resume the tracee once:
//! the program makes the calls in order, stores each result, stops at the first
//! error and ends on an `int3`. Only calls that neither block nor fork belong in
//! a batch.

use std::io;

use crate::error::{RemoteError, Result};
use crate::memory::Scratch;
use crate::tracee::{is_fault, Stop, Tracee};

/// The program, x86-64, position-independent. With `rbx` = the call table
/// (entries of seven words: number, six arguments; ended by number -1) and
/// `r12` = where results go:
///
/// ```text
/// loop: mov rax, [rbx]       ; 48 8b 03
///       cmp rax, -1          ; 48 83 f8 ff
///       je done              ; 74 30
///       mov rdi, [rbx+8]     ; 48 8b 7b 08
///       mov rsi, [rbx+16]    ; 48 8b 73 10
///       mov rdx, [rbx+24]    ; 48 8b 53 18
///       mov r10, [rbx+32]    ; 4c 8b 53 20
///       mov r8,  [rbx+40]    ; 4c 8b 43 28
///       mov r9,  [rbx+48]    ; 4c 8b 4b 30
///       syscall              ; 0f 05
///       mov [r12], rax       ; 49 89 04 24
///       add r12, 8           ; 49 83 c4 08
///       cmp rax, -4095       ; 48 3d 01 f0 ff ff
///       jae done             ; 73 06
///       add rbx, 56          ; 48 83 c3 38
///       jmp loop             ; eb c7
/// done: int3                 ; cc
/// ```
const PROGRAM: [u8; 58] = [
    0x48, 0x8b, 0x03, 0x48, 0x83, 0xf8, 0xff, 0x74, 0x30, 0x48, 0x8b, 0x7b, 0x08, 0x48, 0x8b, 0x73,
    0x10, 0x48, 0x8b, 0x53, 0x18, 0x4c, 0x8b, 0x53, 0x20, 0x4c, 0x8b, 0x43, 0x28, 0x4c, 0x8b, 0x4b,
    0x30, 0x0f, 0x05, 0x49, 0x89, 0x04, 0x24, 0x49, 0x83, 0xc4, 0x08, 0x48, 0x3d, 0x01, 0xf0, 0xff,
    0xff, 0x73, 0x06, 0x48, 0x83, 0xc3, 0x38, 0xeb, 0xc7, 0xcc,
];

/// Where the program's `jae done` (after a failed call) is.
const STOP_ON_ERROR: usize = 49;
const _: () = assert!(PROGRAM[STOP_ON_ERROR] == 0x73 && PROGRAM[STOP_ON_ERROR + 1] == 0x06);

/// The program of [`Batch::run_each`]: the same with its `jae done` made a
/// two-byte `nop` (66 90), so a failed call does not end the batch.
const PROGRAM_EACH: [u8; 58] = {
    let mut p = PROGRAM;
    p[STOP_ON_ERROR] = 0x66;
    p[STOP_ON_ERROR + 1] = 0x90;
    p
};

/// One call of a batch: its name and what it is for (for the error), number
/// and arguments.
#[derive(Debug, Clone)]
pub(crate) struct Call {
    pub name: &'static str,
    pub context: String,
    pub nr: i64,
    pub args: [u64; 6],
}

/// Calls to run in one go with [`Batch::run`].
#[derive(Debug, Default)]
pub(crate) struct Batch {
    calls: Vec<Call>,
}

impl Batch {
    pub fn new() -> Batch {
        Batch::default()
    }

    /// How many calls it holds.
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    /// Add a call (`args` beyond the sixth are an error in the caller's code;
    /// missing ones are 0).
    pub fn push(&mut self, name: &'static str, context: String, nr: i64, args: &[u64]) {
        let mut all = [0u64; 6];
        all[..args.len()].copy_from_slice(args);
        self.calls.push(Call {
            name,
            context,
            nr,
            args: all,
        });
    }

    /// Run every call in `tracee` (stopped; its scratch area mapped executable
    /// in `scratch`) and return their results in order. The first call that
    /// fails ends the batch with [`RemoteError::Injected`] for it. The tracee
    /// ends stopped; its registers are put back by [`Tracee::restore_regs`].
    pub fn run(self, tracee: &mut Tracee, scratch: &mut Scratch) -> Result<Vec<u64>> {
        let results = self.run_with(tracee, scratch, &PROGRAM)?;
        Ok(results.into_iter().map(|r| r as u64).collect())
    }

    /// As [`Batch::run`], but every call is made whatever the ones before it
    /// returned: calls whose failure is no error (best effort). Returns each
    /// call's result as the kernel gave it (`-errno` on failure).
    pub fn run_each(self, tracee: &mut Tracee, scratch: &mut Scratch) -> Result<Vec<i64>> {
        self.run_with(tracee, scratch, &PROGRAM_EACH)
    }

    fn run_with(
        self,
        tracee: &mut Tracee,
        scratch: &mut Scratch,
        code: &[u8; 58],
    ) -> Result<Vec<i64>> {
        if self.calls.is_empty() {
            return Ok(Vec::new());
        }
        let stop_on_error = code[STOP_ON_ERROR] == PROGRAM[STOP_ON_ERROR];
        let program = scratch.put(tracee, code)?;
        // As many calls a round as the scratch area holds (a call is 56 bytes
        // of table and 8 of result).
        let per_round = (scratch.free().saturating_sub(8) / 64).max(1);
        let mut results = Vec::with_capacity(self.calls.len());
        for round in self.calls.chunks(per_round) {
            let mark = scratch.mark();
            let got = run_round(tracee, scratch, program, round, stop_on_error);
            scratch.rewind(mark);
            results.extend(got?);
        }
        Ok(results)
    }
}

/// Run `calls` with the program at `program`: see [`Batch::run`].
fn run_round(
    tracee: &mut Tracee,
    scratch: &mut Scratch,
    program: u64,
    calls: &[Call],
    stop_on_error: bool,
) -> Result<Vec<i64>> {
    let mut table = Vec::with_capacity((calls.len() * 7 + 1) * 8);
    for call in calls {
        table.extend_from_slice(&call.nr.to_ne_bytes());
        for arg in call.args {
            table.extend_from_slice(&arg.to_ne_bytes());
        }
    }
    table.extend_from_slice(&(-1i64).to_ne_bytes());
    let table_addr = scratch.put(tracee, &table)?;
    let results_addr = scratch.reserve(calls.len() * 8)?;

    let mut regs = match tracee.current {
        Some(regs) => regs,
        None => tracee.get_regs()?,
    };
    regs.rip = program;
    regs.rbx = table_addr;
    regs.r12 = results_addr;
    // Not in a syscall: the kernel's restart logic must leave the program alone.
    regs.orig_rax = u64::MAX;
    tracee.set_regs(&regs)?;
    let end = program + PROGRAM.len() as u64;
    let after = loop {
        tracee.resume(libc::PTRACE_CONT, 0)?;
        match tracee.wait_blocking()? {
            Stop::Signal(libc::SIGTRAP) => {
                let after = tracee.get_regs()?;
                tracee.current = Some(after);
                if after.rip == end {
                    tracee.settle()?;
                    break after;
                }
                return Err(RemoteError::NotStopped {
                    pid: tracee.pid(),
                    what: "at the end of an injected batch of syscalls",
                });
            }
            Stop::Signal(sig) if is_fault(sig) => {
                return Err(RemoteError::Faulted {
                    pid: tracee.pid(),
                    signal: sig,
                    what: "in an injected batch of syscalls",
                })
            }
            Stop::Signal(sig) => tracee.defer(sig),
            Stop::Interrupt | Stop::OtherEvent(_) | Stop::NewChild(_) => {}
        }
    };
    let done = ((after.r12.saturating_sub(results_addr)) / 8) as usize;
    let mut raw = vec![0u8; done * 8];
    tracee.read_mem(results_addr, &mut raw)?;
    let results: Vec<i64> = raw
        .chunks_exact(8)
        .map(|c| i64::from_ne_bytes(c.try_into().unwrap_or_default()))
        .collect();
    if let Some((i, &rax)) = results
        .iter()
        .enumerate()
        .find(|(_, r)| stop_on_error && (-4095..0).contains(*r))
    {
        let call = &calls[i];
        return Err(RemoteError::Injected {
            syscall: call.name,
            pid: tracee.pid(),
            context: call.context.clone(),
            source: io::Error::from_raw_os_error(-rax as i32),
        });
    }
    if results.len() != calls.len() {
        return Err(RemoteError::NotStopped {
            pid: tracee.pid(),
            what: "after every call of an injected batch",
        });
    }
    Ok(results)
}
