//! A tiny classic-BPF interpreter for tests: runs a compiled [`Program`] against a
//! synthetic `seccomp_data` and decodes the verdict.
//!
//! It implements exactly the subset the code generator emits and, like the kernel's
//! checker, rejects (by panicking) anything else: unknown opcodes, jumps out of the
//! program, unaligned or out-of-range loads, a last instruction that is not `ret`.

use crate::bpf::{
    Program, ALU_AND_K, AUDIT_ARCH_X86_64, JMP_JA, JMP_JEQ_K, JMP_JGE_K, JMP_JGT_K, JMP_JSET_K,
    LD_W_ABS, MAX_INSNS, RET_K,
};
use crate::profile::Action;

/// `struct seccomp_data`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Data {
    pub nr: u32,
    pub arch: u32,
    pub instruction_pointer: u64,
    pub args: [u64; 6],
}

impl Data {
    /// A native x86_64 call.
    pub(crate) fn x86_64(nr: u32, args: [u64; 6]) -> Self {
        Data {
            nr,
            arch: AUDIT_ARCH_X86_64,
            instruction_pointer: 0x7fff_0000_1234,
            args,
        }
    }

    /// The little-endian in-memory layout the kernel hands to the filter.
    fn bytes(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0..4].copy_from_slice(&self.nr.to_le_bytes());
        b[4..8].copy_from_slice(&self.arch.to_le_bytes());
        b[8..16].copy_from_slice(&self.instruction_pointer.to_le_bytes());
        for (i, arg) in self.args.iter().enumerate() {
            b[16 + 8 * i..24 + 8 * i].copy_from_slice(&arg.to_le_bytes());
        }
        b
    }
}

/// Run `program` on `data` and decode the returned action.
pub(crate) fn run(program: &Program, data: &Data) -> Action {
    let ret = run_raw(program.instructions(), data);
    Action::from_ret_value(ret)
        .unwrap_or_else(|| panic!("filter returned undecodable value {ret:#x}"))
}

/// Run raw instructions; returns the `ret` value.
pub(crate) fn run_raw(insns: &[libc::sock_filter], data: &Data) -> u32 {
    assert!(
        !insns.is_empty() && insns.len() <= MAX_INSNS,
        "bad program length {}",
        insns.len()
    );
    assert_eq!(
        insns[insns.len() - 1].code,
        RET_K,
        "last instruction must be ret"
    );
    let mem = data.bytes();
    let mut acc: u32 = 0;
    let mut pc = 0usize;
    loop {
        let ins = insns
            .get(pc)
            .unwrap_or_else(|| panic!("pc {pc} ran off the program"));
        let next = pc + 1;
        let target = |off: usize| {
            let t = next + off;
            assert!(t < insns.len(), "jump at {pc} to {t} leaves the program");
            t
        };
        pc = match ins.code {
            LD_W_ABS => {
                let k = ins.k as usize;
                assert!(
                    k & 3 == 0 && k + 4 <= mem.len(),
                    "bad load offset {k} at {pc}"
                );
                acc = u32::from_le_bytes(mem[k..k + 4].try_into().expect("4 bytes"));
                next
            }
            ALU_AND_K => {
                acc &= ins.k;
                next
            }
            RET_K => return ins.k,
            JMP_JA => target(ins.k as usize),
            JMP_JEQ_K | JMP_JGT_K | JMP_JGE_K | JMP_JSET_K => {
                let taken = match ins.code {
                    JMP_JEQ_K => acc == ins.k,
                    JMP_JGT_K => acc > ins.k,
                    JMP_JGE_K => acc >= ins.k,
                    _ => acc & ins.k != 0,
                };
                // Both targets must be valid whichever is taken (the kernel checks both).
                let (t, f) = (target(usize::from(ins.jt)), target(usize::from(ins.jf)));
                if taken {
                    t
                } else {
                    f
                }
            }
            code => panic!("unsupported opcode {code:#x} at {pc}"),
        };
    }
}
