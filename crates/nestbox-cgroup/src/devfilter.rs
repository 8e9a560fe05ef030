//! Cgroup v2 device control: v2 has no `devices.allow` file; a cgroup's
//! device access is decided by a `BPF_PROG_TYPE_CGROUP_DEVICE` program
//! attached to it. [`program`] turns a box's device rules into one, with the
//! meaning they have on v1 after `devices.deny a`: the rules in order, the
//! last one that matches a request decides, and a request no rule matches is
//! denied. A rule matches when its type is `a` or the request's, its major
//! and minor are wildcards or equal, and the access asked for is within the
//! rule's (as runc's filter does: a deny of `w` does not match a request for
//! `rw`). [`attach`] loads the program and attaches it to a v2 directory.

use std::os::fd::AsFd;
use std::path::Path;

use crate::error::{CgroupError, Op};
use crate::DeviceRule;

const BPF_PROG_TYPE_CGROUP_DEVICE: u32 = 15;
const BPF_CGROUP_DEVICE: u32 = 6;
const BPF_F_ALLOW_MULTI: u32 = 2;

// Opcodes (eBPF).
const LDX_W: u8 = 0x61; // dst = *(u32 *)(src + off)
const MOV_X: u8 = 0xbf; // dst = src (64-bit)
const MOV_K: u8 = 0xb7; // dst = imm
const AND_K: u8 = 0x57; // dst &= imm
const RSH_K: u8 = 0x77; // dst >>= imm
const JNE_K: u8 = 0x55; // if dst != imm goto +off
const EXIT: u8 = 0x95;

// struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }:
// access_type = access << 16 | type.
const DEV_BLOCK: i32 = 1;
const DEV_CHAR: i32 = 2;
const ACC_MKNOD: i32 = 1;
const ACC_READ: i32 = 2;
const ACC_WRITE: i32 = 4;

fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> [u8; 8] {
    nestbox_sys::bpf::insn(code, dst, src, off, imm)
}

fn access_bits(access: &str) -> i32 {
    access.chars().fold(0, |a, c| {
        a | match c {
            'r' => ACC_READ,
            'w' => ACC_WRITE,
            'm' => ACC_MKNOD,
            _ => 0,
        }
    })
}

/// The program for `rules` (see the module documentation).
pub(crate) fn program(rules: &[DeviceRule]) -> Vec<[u8; 8]> {
    // r2: access, r3: type, r4: major, r5: minor.
    let mut code = vec![
        insn(LDX_W, 2, 1, 0, 0),
        insn(MOV_X, 3, 2, 0, 0),
        insn(AND_K, 3, 0, 0, 0xffff),
        insn(RSH_K, 2, 0, 0, 16),
        insn(LDX_W, 4, 1, 4, 0),
        insn(LDX_W, 5, 1, 8, 0),
    ];
    // The last rule that matches decides: test them from the last.
    for rule in rules.iter().rev() {
        // Each check jumps past the rest of this rule's block when it fails;
        // the offsets are set once the block's length is known.
        let mut block: Vec<[u8; 8]> = Vec::new();
        let mut jumps = Vec::new();
        match rule.kind {
            'b' | 'c' => {
                jumps.push(block.len());
                let t = if rule.kind == 'b' {
                    DEV_BLOCK
                } else {
                    DEV_CHAR
                };
                block.push(insn(JNE_K, 3, 0, 0, t));
            }
            _ => {}
        }
        for (reg, num) in [(4, rule.major), (5, rule.minor)] {
            if let Some(n) = num.filter(|n| *n >= 0) {
                jumps.push(block.len());
                block.push(insn(JNE_K, reg, 0, 0, n as i32));
            }
        }
        let allowed = access_bits(&rule.access);
        let all = ACC_READ | ACC_WRITE | ACC_MKNOD;
        if allowed & all != all {
            // r6 = access & ~allowed; a request beyond the rule's access
            // does not match it.
            block.push(insn(MOV_X, 6, 2, 0, 0));
            block.push(insn(AND_K, 6, 0, 0, !allowed & all));
            jumps.push(block.len());
            block.push(insn(JNE_K, 6, 0, 0, 0));
        }
        block.push(insn(MOV_K, 0, 0, 0, i32::from(rule.allow)));
        block.push(insn(EXIT, 0, 0, 0, 0));
        let len = block.len();
        let unconditional = jumps.is_empty();
        for at in jumps {
            let off = (len - at - 1) as i16;
            block[at][2..4].copy_from_slice(&off.to_le_bytes());
        }
        code.extend(block);
        if unconditional {
            // It matches every request: the rules before it are never
            // reached, and the verifier refuses unreachable code.
            return code;
        }
    }
    code.push(insn(MOV_K, 0, 0, 0, 0));
    code.push(insn(EXIT, 0, 0, 0, 0));
    code
}

/// Load the program for `rules` and attach it to the v2 cgroup `dir`
/// (alongside any others: `BPF_F_ALLOW_MULTI`; the kernel allows a request
/// only if every program on the way from the root allows it).
pub fn attach(dir: &Path, rules: &[DeviceRule]) -> Result<(), CgroupError> {
    let sys = |what: &'static str| {
        move |e: nix::errno::Errno| {
            CgroupError::io(
                Op::Write,
                dir,
                std::io::Error::other(format!("{what}: {e}")),
            )
        }
    };
    let mut log = vec![0u8; 16 * 1024];
    let prog = nestbox_sys::bpf::prog_load(
        BPF_PROG_TYPE_CGROUP_DEVICE,
        &program(rules),
        "nestbox_devices",
        Some(&mut log),
    )
    .map_err(|e| {
        let text = String::from_utf8_lossy(&log);
        // The line before the statistics names the problem.
        let last = text
            .trim_end_matches('\0')
            .trim()
            .lines()
            .rfind(|l| !l.starts_with("processed ") && !l.trim().is_empty())
            .unwrap_or("");
        CgroupError::io(
            Op::Write,
            dir,
            std::io::Error::other(format!(
                "bpf(BPF_PROG_LOAD device program): {e} (verifier: {last})"
            )),
        )
    })?;
    let d = std::fs::File::open(dir).map_err(|e| CgroupError::io(Op::Read, dir, e))?;
    nestbox_sys::bpf::prog_attach(
        d.as_fd(),
        prog.as_fd(),
        BPF_CGROUP_DEVICE,
        BPF_F_ALLOW_MULTI,
    )
    .map_err(sys("bpf(BPF_PROG_ATTACH, BPF_CGROUP_DEVICE)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `code` on one request, as the kernel would (the subset of eBPF
    /// [`program`] emits).
    fn run(code: &[[u8; 8]], kind: i32, access: i32, major: u32, minor: u32) -> u64 {
        let ctx = [((access as u32) << 16) | kind as u32, major, minor];
        let mut r = [0u64; 11];
        let mut pc = 0usize;
        loop {
            let i = code[pc];
            let (dst, src) = ((i[1] & 0x0f) as usize, (i[1] >> 4) as usize);
            let off = i16::from_le_bytes([i[2], i[3]]);
            let imm = i32::from_le_bytes([i[4], i[5], i[6], i[7]]);
            pc += 1;
            match i[0] {
                LDX_W => {
                    assert_eq!(src, 1);
                    r[dst] = u64::from(ctx[off as usize / 4]);
                }
                MOV_X => r[dst] = r[src],
                MOV_K => r[dst] = imm as i64 as u64,
                AND_K => r[dst] &= imm as i64 as u64,
                RSH_K => r[dst] >>= imm,
                JNE_K => {
                    if r[dst] != imm as i64 as u64 {
                        pc += off as usize;
                    }
                }
                EXIT => return r[0],
                op => panic!("opcode {op:#x}"),
            }
        }
    }

    #[test]
    fn the_last_matching_rule_decides_and_nothing_matched_is_denied() {
        let rules = [
            DeviceRule::new(true, 'a', None, None, "rwm"),
            DeviceRule::new(false, 'c', Some(1), Some(3), "rwm"),
            DeviceRule::new(true, 'c', Some(1), None, "r"),
        ];
        let code = program(&rules);
        let (r, w) = (ACC_READ, ACC_WRITE);
        // /dev/null (c 1:3): read allowed again by the last rule, write denied.
        assert_eq!(run(&code, DEV_CHAR, r, 1, 3), 1);
        assert_eq!(run(&code, DEV_CHAR, w, 1, 3), 0);
        assert_eq!(run(&code, DEV_CHAR, r | w, 1, 3), 0);
        // Any other device: the first rule.
        assert_eq!(run(&code, DEV_CHAR, r | w, 1, 5), 1);
        assert_eq!(run(&code, DEV_BLOCK, w, 8, 0), 1);
        // A rule for everything ends the program (what is before it in the
        // list is never reached, and no instruction follows it).
        let ends = program(&rules[..1]);
        assert_eq!(ends.len(), 8, "6 loads and shifts, then r0 = 1; exit");
        assert_eq!(run(&ends, DEV_BLOCK, ACC_MKNOD, 8, 1), 1);
        // No rules: everything denied.
        assert_eq!(run(&program(&[]), DEV_CHAR, r, 1, 3), 0);
        // Type and numbers must match.
        let only_zero = program(&[DeviceRule::new(true, 'c', Some(1), Some(5), "rw")]);
        assert_eq!(run(&only_zero, DEV_CHAR, r, 1, 5), 1);
        assert_eq!(run(&only_zero, DEV_BLOCK, r, 1, 5), 0);
        assert_eq!(run(&only_zero, DEV_CHAR, r, 1, 6), 0);
        assert_eq!(run(&only_zero, DEV_CHAR, ACC_MKNOD, 1, 5), 0);
    }
}
