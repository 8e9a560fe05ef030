//! Classic BPF as seccomp uses it: the opcodes we emit, the `seccomp_data` layout
//! they read, and [`Program`], a finished instruction list.
//!
//! Only a small subset of cBPF is generated: absolute 32-bit loads from
//! `seccomp_data`, `and` with a constant, the `jeq`/`jgt`/`jge`/`jset` conditional
//! jumps (8-bit forward offsets), `ja` (32-bit forward offset) and `ret`.

use std::fmt;

/// `BPF_LD | BPF_W | BPF_ABS`: `A = *(u32 *)(seccomp_data + k)`.
pub(crate) const LD_W_ABS: u16 = 0x20;
/// `BPF_ALU | BPF_AND | BPF_K`: `A &= k`.
pub(crate) const ALU_AND_K: u16 = 0x54;
/// `BPF_JMP | BPF_JA`: `pc += k`.
pub(crate) const JMP_JA: u16 = 0x05;
/// `BPF_JMP | BPF_JEQ | BPF_K`.
pub(crate) const JMP_JEQ_K: u16 = 0x15;
/// `BPF_JMP | BPF_JGT | BPF_K`.
pub(crate) const JMP_JGT_K: u16 = 0x25;
/// `BPF_JMP | BPF_JGE | BPF_K`.
pub(crate) const JMP_JGE_K: u16 = 0x35;
/// `BPF_JMP | BPF_JSET | BPF_K`.
pub(crate) const JMP_JSET_K: u16 = 0x45;
/// `BPF_RET | BPF_K`: return `k`.
pub(crate) const RET_K: u16 = 0x06;

/// The kernel's limit on one filter's length (`BPF_MAXINSNS`).
pub const MAX_INSNS: usize = 4096;

/// `AUDIT_ARCH_X86_64`: `EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE`.
pub const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;

/// Offset of `seccomp_data.nr` (int).
pub(crate) const OFF_NR: u32 = 0;
/// Offset of `seccomp_data.arch` (u32).
pub(crate) const OFF_ARCH: u32 = 4;

/// Offset of the low 32 bits of `seccomp_data.args[index]` (little-endian u64s at 16).
pub(crate) const fn off_arg_lo(index: u8) -> u32 {
    16 + 8 * index as u32
}

/// Offset of the high 32 bits of `seccomp_data.args[index]`.
pub(crate) const fn off_arg_hi(index: u8) -> u32 {
    off_arg_lo(index) + 4
}

/// Build one instruction.
pub(crate) const fn insn(code: u16, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

/// A compiled seccomp filter: a list of classic BPF instructions of at most
/// [`MAX_INSNS`] entries, produced by [`Profile::compile`](crate::Profile::compile)
/// and installed with [`Program::install`].
#[derive(Clone)]
pub struct Program {
    pub(crate) insns: Vec<libc::sock_filter>,
}

impl Program {
    /// Number of instructions.
    pub fn len(&self) -> usize {
        self.insns.len()
    }

    /// Always `false` for a compiled program (it ends in at least one `ret`).
    pub fn is_empty(&self) -> bool {
        self.insns.is_empty()
    }

    /// The raw instructions, as the kernel receives them.
    pub fn instructions(&self) -> &[libc::sock_filter] {
        &self.insns
    }
}

impl fmt::Debug for Program {
    /// One line per instruction: `index: code jt jf k` in hex, like `bpf_dbg`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "Program ({} instructions)", self.insns.len())?;
        for (i, ins) in self.insns.iter().enumerate() {
            writeln!(
                f,
                "{i:4}: {:#06x} {:3} {:3} {:#010x}",
                ins.code, ins.jt, ins.jf, ins.k
            )?;
        }
        Ok(())
    }
}
