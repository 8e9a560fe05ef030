//! Profile -> BPF compiler.
//!
//! The generated program has this shape:
//!
//! ```text
//!   A = arch;  if A != AUDIT_ARCH_X86_64 goto KILL_PROCESS
//!   A = nr;    if A & 0x40000000 goto <x32_action>
//!   binary search on nr over the syscalls that have rules
//!       -> an action's `ret` directly when the syscall's first rule is unconditional
//!       -> the syscall's rule body otherwise
//!       -> <default_action> when the syscall has no rules
//!   rule bodies: per rule, the 64-bit argument checks (high word, then low word),
//!       failing to the next rule of the same syscall, the last one to the default
//!   one shared `ret` per distinct action
//! ```
//!
//! Code is first produced as a list of [`Op`]s with symbolic labels, then laid out.
//! Conditional jumps in cBPF only have 8-bit offsets, so layout is iterative: any
//! conditional jump whose target ends up more than 255 instructions away is widened
//! to `jcond 0,1; ja jt; ja jf` (`ja` has a 32-bit offset), which can push other
//! jumps out of range, until nothing changes. Widening only ever grows code, so this
//! terminates.

use std::collections::BTreeMap;

use crate::bpf::{
    self, insn, Program, ALU_AND_K, AUDIT_ARCH_X86_64, JMP_JA, JMP_JEQ_K, JMP_JGE_K, JMP_JGT_K,
    JMP_JSET_K, LD_W_ABS, MAX_INSNS, OFF_ARCH, OFF_NR, RET_K,
};
use crate::error::SeccompError;
use crate::profile::{Action, ArgCondition, CmpOp, Profile, Rule, X32_SYSCALL_BIT};

/// Syscall groups at or below this count are dispatched with a linear `jeq` chain
/// rather than by splitting further.
const LINEAR_DISPATCH: usize = 4;

/// A symbolic jump target, placed with [`Op::Place`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Label(usize);

/// Where a conditional jump goes.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// The instruction after this jump (offset 0).
    Next,
    /// A label.
    To(Label),
}

/// One instruction (or a label position) before layout.
#[derive(Debug, Clone, Copy)]
enum Op {
    /// `A = seccomp_data[k]` (32 bits).
    Load(u32),
    /// `A &= k`.
    And(u32),
    /// Conditional jump `code` against constant `k`.
    Jump {
        code: u16,
        k: u32,
        jt: Target,
        jf: Target,
    },
    /// Unconditional jump.
    Goto(Label),
    /// Return a `SECCOMP_RET_*` value.
    Ret(u32),
    /// Position of a label (emits nothing).
    Place(Label),
}

/// Accumulates [`Op`]s.
#[derive(Debug, Default)]
struct Builder {
    ops: Vec<Op>,
    next_label: usize,
    /// One shared `ret` per distinct action.
    returns: BTreeMap<Action, Label>,
}

impl Builder {
    fn label(&mut self) -> Label {
        self.next_label += 1;
        Label(self.next_label - 1)
    }

    fn ret_label(&mut self, action: Action) -> Label {
        if let Some(label) = self.returns.get(&action) {
            return *label;
        }
        let label = self.label();
        self.returns.insert(action, label);
        label
    }

    fn push(&mut self, op: Op) {
        self.ops.push(op);
    }

    fn jump(&mut self, code: u16, k: u32, jt: Target, jf: Target) {
        self.push(Op::Jump { code, k, jt, jf });
    }

    /// Dispatch on `A == nr` over `entries` (sorted by number) by binary search.
    fn dispatch(&mut self, entries: &[(u32, Label)], default: Label) {
        if entries.len() <= LINEAR_DISPATCH {
            for (i, &(nr, target)) in entries.iter().enumerate() {
                let jf = if i + 1 == entries.len() {
                    Target::To(default)
                } else {
                    Target::Next
                };
                self.jump(JMP_JEQ_K, nr, Target::To(target), jf);
            }
            if entries.is_empty() {
                self.push(Op::Goto(default));
            }
            return;
        }
        let mid = entries.len() / 2;
        let upper = self.label();
        self.jump(JMP_JGE_K, entries[mid].0, Target::To(upper), Target::Next);
        self.dispatch(&entries[..mid], default);
        self.push(Op::Place(upper));
        self.dispatch(&entries[mid..], default);
    }

    /// Emit the checks of one condition: jump to `pass` if it holds, else to `fail`.
    fn condition(&mut self, cond: &ArgCondition, pass: Label, fail: Label) {
        let (pass, fail) = (Target::To(pass), Target::To(fail));
        let hi_off = bpf::off_arg_hi(cond.arg);
        let lo_off = bpf::off_arg_lo(cond.arg);
        let hi = (cond.value >> 32) as u32;
        let lo = cond.value as u32;
        match cond.op {
            CmpOp::Eq => {
                self.push(Op::Load(hi_off));
                self.jump(JMP_JEQ_K, hi, Target::Next, fail);
                self.push(Op::Load(lo_off));
                self.jump(JMP_JEQ_K, lo, pass, fail);
            }
            CmpOp::Ne => {
                self.push(Op::Load(hi_off));
                self.jump(JMP_JEQ_K, hi, Target::Next, pass);
                self.push(Op::Load(lo_off));
                self.jump(JMP_JEQ_K, lo, fail, pass);
            }
            CmpOp::MaskedEq(mask) => {
                let (mask_hi, mask_lo) = ((mask >> 32) as u32, mask as u32);
                // With the high half masked off and a zero expected high half, the
                // high-word test always passes; skip it (the `int` argument case).
                if mask_hi != 0 || hi != 0 {
                    self.push(Op::Load(hi_off));
                    if mask_hi != u32::MAX {
                        self.push(Op::And(mask_hi));
                    }
                    self.jump(JMP_JEQ_K, hi, Target::Next, fail);
                }
                self.push(Op::Load(lo_off));
                if mask_lo != u32::MAX {
                    self.push(Op::And(mask_lo));
                }
                self.jump(JMP_JEQ_K, lo, pass, fail);
            }
            CmpOp::Gt | CmpOp::Ge => {
                // hi > v.hi: true; hi < v.hi: false; equal: decided by the low word.
                self.push(Op::Load(hi_off));
                self.jump(JMP_JGT_K, hi, pass, Target::Next);
                self.jump(JMP_JEQ_K, hi, Target::Next, fail);
                self.push(Op::Load(lo_off));
                let code = if cond.op == CmpOp::Gt {
                    JMP_JGT_K
                } else {
                    JMP_JGE_K
                };
                self.jump(code, lo, pass, fail);
            }
            CmpOp::Lt | CmpOp::Le => {
                // hi > v.hi: false; hi < v.hi: true; equal: decided by the low word.
                self.push(Op::Load(hi_off));
                self.jump(JMP_JGT_K, hi, fail, Target::Next);
                self.jump(JMP_JEQ_K, hi, Target::Next, pass);
                self.push(Op::Load(lo_off));
                // lo < v  <=>  !(lo >= v);  lo <= v  <=>  !(lo > v)
                let code = if cond.op == CmpOp::Lt {
                    JMP_JGE_K
                } else {
                    JMP_JGT_K
                };
                self.jump(code, lo, fail, pass);
            }
        }
    }

    /// Emit the rules of one syscall, in order; falling off the end goes to `default`.
    fn rule_body(&mut self, rules: &[&Rule], default: Label) {
        for rule in rules {
            let action = self.ret_label(rule.action);
            let Some((last, init)) = rule.conditions.split_last() else {
                // Unconditional: later rules for this syscall can never match.
                self.push(Op::Goto(action));
                return;
            };
            let next_rule = self.label();
            for cond in init {
                let next_cond = self.label();
                self.condition(cond, next_cond, next_rule);
                self.push(Op::Place(next_cond));
            }
            self.condition(last, action, next_rule);
            self.push(Op::Place(next_rule));
        }
        self.push(Op::Goto(default));
    }
}

impl Profile {
    /// Validate the profile and compile it to a seccomp BPF program (see the
    /// `codegen` module documentation for the program's shape).
    ///
    /// # Errors
    /// [`SeccompError::InvalidRule`] / [`SeccompError::InvalidAction`] when a rule or
    /// action cannot be encoded (see [`Profile::validate`]);
    /// [`SeccompError::ProgramTooLong`] beyond [`MAX_INSNS`] instructions.
    pub fn compile(&self) -> Result<Program, SeccompError> {
        compile(self)
    }
}

/// Compile `profile` (see the module documentation for the program's shape).
fn compile(profile: &Profile) -> Result<Program, SeccompError> {
    profile.validate()?;
    let mut b = Builder::default();

    let kill = b.ret_label(Action::KillProcess);
    b.push(Op::Load(OFF_ARCH));
    b.jump(JMP_JEQ_K, AUDIT_ARCH_X86_64, Target::Next, Target::To(kill));
    b.push(Op::Load(OFF_NR));
    let x32 = b.ret_label(profile.x32_action);
    b.jump(JMP_JSET_K, X32_SYSCALL_BIT, Target::To(x32), Target::Next);

    // Rules grouped per syscall, numbers ascending, file order kept within a group.
    let mut groups: BTreeMap<u32, Vec<&Rule>> = BTreeMap::new();
    for rule in &profile.rules {
        groups.entry(rule.syscall).or_default().push(rule);
    }
    let default = b.ret_label(profile.default_action);
    let mut entries = Vec::with_capacity(groups.len());
    let mut bodies = Vec::new();
    for (&nr, rules) in &groups {
        let first = rules[0];
        if first.conditions.is_empty() {
            // Decided without looking at arguments; a group that just restates the
            // default needs no dispatch entry at all.
            if first.action != profile.default_action {
                entries.push((nr, b.ret_label(first.action)));
            }
        } else {
            let body = b.label();
            entries.push((nr, body));
            bodies.push((body, rules));
        }
    }
    b.dispatch(&entries, default);
    for (body, rules) in bodies {
        b.push(Op::Place(body));
        b.rule_body(rules, default);
    }
    let returns: Vec<(Action, Label)> = b.returns.iter().map(|(a, l)| (*a, *l)).collect();
    for (action, label) in returns {
        b.push(Op::Place(label));
        b.push(Op::Ret(action.ret_value()));
    }

    let insns = layout(&b.ops, b.next_label);
    if insns.len() > MAX_INSNS {
        return Err(SeccompError::ProgramTooLong {
            len: insns.len(),
            max: MAX_INSNS,
        });
    }
    Ok(Program { insns })
}

/// Distance from the instruction after `from` to `to`; targets are always forward.
fn forward(from: usize, to: usize) -> usize {
    to.checked_sub(from + 1)
        .expect("seccomp codegen emitted a backward jump")
}

/// Resolve labels, widening out-of-range conditional jumps (see module docs).
fn layout(ops: &[Op], labels: usize) -> Vec<libc::sock_filter> {
    // Instructions each op occupies; only conditional jumps ever change (1 -> 3).
    let mut sizes: Vec<usize> = ops
        .iter()
        .map(|op| match op {
            Op::Place(_) => 0,
            _ => 1,
        })
        .collect();
    let mut starts = vec![0usize; ops.len()];
    let mut label_pos = vec![usize::MAX; labels];
    let resolve = |target: Target, after: usize, label_pos: &[usize]| match target {
        Target::Next => after,
        Target::To(Label(l)) => label_pos[l],
    };

    loop {
        let mut pc = 0;
        for (i, op) in ops.iter().enumerate() {
            starts[i] = pc;
            if let Op::Place(Label(l)) = op {
                label_pos[*l] = pc;
            }
            pc += sizes[i];
        }
        let mut widened = false;
        for (i, op) in ops.iter().enumerate() {
            if let (Op::Jump { jt, jf, .. }, 1) = (op, sizes[i]) {
                let after = starts[i] + 1;
                let t = forward(starts[i], resolve(*jt, after, &label_pos));
                let f = forward(starts[i], resolve(*jf, after, &label_pos));
                if t > usize::from(u8::MAX) || f > usize::from(u8::MAX) {
                    sizes[i] = 3;
                    widened = true;
                }
            }
        }
        if !widened {
            break;
        }
    }

    let mut out = Vec::with_capacity(starts.last().map_or(0, |s| s + 3));
    for (i, op) in ops.iter().enumerate() {
        let at = starts[i];
        debug_assert_eq!(at, out.len());
        match *op {
            Op::Place(_) => {}
            Op::Load(k) => out.push(insn(LD_W_ABS, 0, 0, k)),
            Op::And(k) => out.push(insn(ALU_AND_K, 0, 0, k)),
            Op::Ret(k) => out.push(insn(RET_K, 0, 0, k)),
            Op::Goto(Label(l)) => out.push(insn(JMP_JA, 0, 0, ja_offset(at, label_pos[l]))),
            Op::Jump { code, k, jt, jf } => {
                let after = at + sizes[i];
                let t = resolve(jt, after, &label_pos);
                let f = resolve(jf, after, &label_pos);
                if sizes[i] == 1 {
                    // In range: checked by the layout loop above.
                    let jt = u8::try_from(forward(at, t)).expect("jump offset checked by layout");
                    let jf = u8::try_from(forward(at, f)).expect("jump offset checked by layout");
                    out.push(insn(code, jt, jf, k));
                } else {
                    out.push(insn(code, 0, 1, k));
                    out.push(insn(JMP_JA, 0, 0, ja_offset(at + 1, t)));
                    out.push(insn(JMP_JA, 0, 0, ja_offset(at + 2, f)));
                }
            }
        }
    }
    out
}

/// `ja` offset from the `ja` at `from` to `to`.
fn ja_offset(from: usize, to: usize) -> u32 {
    u32::try_from(forward(from, to)).expect("seccomp program offsets fit in u32")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Data};
    use crate::profile::{ENOSYS, EPERM};
    use crate::sysno::syscall_number;

    fn nr(name: &str) -> u32 {
        syscall_number(name).unwrap()
    }

    fn eval(p: &Program, nr: u32, args: [u64; 6]) -> Action {
        run(p, &Data::x86_64(nr, args))
    }

    #[test]
    fn arch_check_and_x32() {
        let p = Profile::new(Action::Allow).compile().unwrap();
        assert_eq!(eval(&p, 0, [0; 6]), Action::Allow);
        let mut d = Data::x86_64(0, [0; 6]);
        d.arch = 0x4000_0003; // AUDIT_ARCH_I386
        assert_eq!(run(&p, &d), Action::KillProcess);
        assert_eq!(eval(&p, X32_SYSCALL_BIT, [0; 6]), Action::Errno(EPERM));
        assert_eq!(
            eval(&p, X32_SYSCALL_BIT | nr("read"), [0; 6]),
            Action::Errno(EPERM)
        );

        let p = Profile::new(Action::Errno(13)).compile().unwrap();
        assert_eq!(eval(&p, X32_SYSCALL_BIT | 1, [0; 6]), Action::Errno(13));
    }

    #[test]
    fn first_match_wins_then_default() {
        let write = nr("write");
        let p = Profile::new(Action::Errno(EPERM))
            .with_rule(Rule::new(write, Action::Allow).when(0, CmpOp::Eq, 1))
            .with_rule(Rule::new(write, Action::Errno(9)).when(0, CmpOp::Le, 2))
            .with_rule(Rule::new(write, Action::Trap).when(0, CmpOp::Eq, 1))
            .with_rule(Rule::new(nr("read"), Action::Allow))
            .compile()
            .unwrap();
        assert_eq!(eval(&p, write, [1, 0, 0, 0, 0, 0]), Action::Allow);
        assert_eq!(eval(&p, write, [2, 0, 0, 0, 0, 0]), Action::Errno(9));
        assert_eq!(eval(&p, write, [0, 0, 0, 0, 0, 0]), Action::Errno(9));
        assert_eq!(eval(&p, write, [3, 0, 0, 0, 0, 0]), Action::Errno(EPERM));
        assert_eq!(eval(&p, nr("read"), [0; 6]), Action::Allow);
        assert_eq!(eval(&p, nr("open"), [0; 6]), Action::Errno(EPERM));
    }

    #[test]
    fn conditions_are_anded() {
        let p = Profile::new(Action::Allow)
            .with_rule(
                Rule::new(9, Action::Errno(EPERM))
                    .when(2, CmpOp::MaskedEq(4), 4)
                    .when(3, CmpOp::Ne, 7),
            )
            .compile()
            .unwrap();
        assert_eq!(eval(&p, 9, [0, 0, 4, 0, 0, 0]), Action::Errno(EPERM));
        assert_eq!(eval(&p, 9, [0, 0, 4, 7, 0, 0]), Action::Allow);
        assert_eq!(eval(&p, 9, [0, 0, 3, 0, 0, 0]), Action::Allow);
    }

    /// Every operator against values around a 64-bit boundary, where getting the
    /// high/low word logic wrong shows.
    #[test]
    fn sixty_four_bit_compares() {
        let pivot: u64 = 0x0000_0001_0000_0005;
        let probes = [
            0,
            4,
            5,
            6,
            0xffff_ffff,
            0x0000_0001_0000_0000,
            0x0000_0001_0000_0004,
            pivot,
            0x0000_0001_0000_0006,
            0x0000_0001_ffff_ffff,
            0x0000_0002_0000_0000,
            0x0000_0002_0000_0005,
            0xffff_ffff_0000_0005,
            u64::MAX,
        ];
        type Oracle = fn(u64, u64) -> bool;
        let ops: [(CmpOp, Oracle); 7] = [
            (CmpOp::Eq, |a, b| a == b),
            (CmpOp::Ne, |a, b| a != b),
            (CmpOp::Lt, |a, b| a < b),
            (CmpOp::Le, |a, b| a <= b),
            (CmpOp::Gt, |a, b| a > b),
            (CmpOp::Ge, |a, b| a >= b),
            (CmpOp::MaskedEq(0xffff_0000_ffff_fff0), |a, b| {
                a & 0xffff_0000_ffff_fff0 == b
            }),
        ];
        for (op, expect) in ops {
            for value in [pivot, 0x0000_0001_0000_0000, 0xffff_ffff, 0] {
                let p = Profile::new(Action::Allow)
                    .with_rule(Rule::new(1, Action::Errno(7)).when(4, op, value))
                    .compile()
                    .unwrap();
                for arg in probes {
                    let want = if expect(arg, value) {
                        Action::Errno(7)
                    } else {
                        Action::Allow
                    };
                    let got = eval(&p, 1, [0, 0, 0, 0, arg, 0]);
                    assert_eq!(got, want, "{op:?} value={value:#x} arg={arg:#x}");
                }
            }
        }
    }

    #[test]
    fn masked_eq_low_word_only_ignores_high_half() {
        let p = Profile::new(Action::Allow)
            .with_rule(Rule::new(41, Action::Errno(EPERM)).when(
                0,
                CmpOp::MaskedEq(0xffff_ffff),
                40,
            ))
            .compile()
            .unwrap();
        assert_eq!(eval(&p, 41, [40, 0, 0, 0, 0, 0]), Action::Errno(EPERM));
        assert_eq!(
            eval(&p, 41, [0xdead_0000_0000_0028, 0, 0, 0, 0, 0]),
            Action::Errno(EPERM)
        );
        assert_eq!(eval(&p, 41, [41, 0, 0, 0, 0, 0]), Action::Allow);
    }

    /// Hundreds of conditional rules push the shared `ret`s and the later syscalls far
    /// beyond an 8-bit jump; every decision must still be right.
    #[test]
    fn long_programs_jump_correctly() {
        let mut p = Profile::new(Action::Errno(ENOSYS));
        for sys in 0..120u32 {
            // Three conditional rules per syscall, distinct action per syscall.
            for v in 0..3u64 {
                p.push(Rule::new(sys, Action::Errno((sys + 1) as u16)).when(
                    (v % 6) as u8,
                    CmpOp::Eq,
                    1000 + v,
                ));
            }
        }
        p.push(Rule::new(400, Action::Allow));
        let prog = p.compile().unwrap();
        assert!(prog.len() > 1500, "program only {} long", prog.len());
        // Some conditional jumps had to be widened into `jcond 0,1; ja; ja`.
        let widened = prog.instructions().windows(3).filter(|w| {
            w[0].code & 0x07 == 0x05
                && w[0].code != JMP_JA
                && (w[0].jt, w[0].jf) == (0, 1)
                && w[1].code == JMP_JA
                && w[2].code == JMP_JA
        });
        assert!(widened.count() > 10);
        for sys in 0..120u32 {
            for v in 0..3u64 {
                let mut args = [0u64; 6];
                args[(v % 6) as usize] = 1000 + v;
                assert_eq!(
                    eval(&prog, sys, args),
                    Action::Errno((sys + 1) as u16),
                    "sys {sys} v {v}"
                );
            }
            assert_eq!(eval(&prog, sys, [0; 6]), Action::Errno(ENOSYS));
        }
        assert_eq!(eval(&prog, 400, [0; 6]), Action::Allow);
        assert_eq!(eval(&prog, 401, [0; 6]), Action::Errno(ENOSYS));
    }

    #[test]
    fn too_long_is_an_error() {
        let mut p = Profile::new(Action::Allow);
        for sys in 0..1000u32 {
            p.push(Rule::new(sys, Action::Errno(1)).when(0, CmpOp::Eq, u64::from(sys)));
        }
        let e = p.compile().unwrap_err();
        assert!(
            matches!(e, SeccompError::ProgramTooLong { max: 4096, .. }),
            "{e}"
        );
    }

    #[test]
    fn rules_restating_the_default_cost_nothing() {
        let base = Profile::new(Action::Allow).compile().unwrap().len();
        let p = Profile::new(Action::Allow)
            .with_rule(Rule::new(0, Action::Allow))
            .compile()
            .unwrap();
        assert_eq!(p.len(), base);
    }
}
