//! The filter model: a [`Profile`] is a default [`Action`] plus an ordered list of
//! [`Rule`]s, each naming one x86_64 syscall, an action and optional conditions on the
//! syscall's arguments.
//!
//! Semantics, as implemented by [`Profile::compile`]:
//! * a call from a foreign architecture (i386 via `int 0x80`, ...) kills the process;
//! * an x32-ABI call (number with bit `0x4000_0000` set) gets [`Profile::x32_action`];
//! * otherwise the rules *for that syscall* are tried in the order they appear in
//!   [`Profile::rules`]; the first whose conditions all hold decides;
//! * if none matches, [`Profile::default_action`] decides.
//!
//! Argument conditions compare the full 64-bit argument value, unsigned.

use serde::{Deserialize, Serialize};

use crate::error::SeccompError;
use crate::sysno;

/// `EPERM`, the errno the deny-list profiles return.
pub const EPERM: u16 = 1;
/// `ENOSYS`, returned for calls that should look unimplemented (so libc falls back).
pub const ENOSYS: u16 = 38;
/// Largest errno the kernel passes through (`MAX_ERRNO`).
pub const MAX_ERRNO: u16 = 4095;

/// What the kernel does with a matching syscall.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Action {
    /// Let the call run.
    Allow,
    /// Fail the call with this errno (0..=4095) without running it; 0 makes the call
    /// return 0 ("fake success").
    Errno(u16),
    /// Kill the whole process (`SECCOMP_RET_KILL_PROCESS`).
    KillProcess,
    /// Kill only the calling thread (`SECCOMP_RET_KILL_THREAD`, libseccomp's `SCMP_ACT_KILL`).
    KillThread,
    /// Deliver `SIGSYS` to the calling thread (`SECCOMP_RET_TRAP`).
    Trap,
    /// Let the call run but log it to the audit log (`SECCOMP_RET_LOG`).
    Log,
    /// Stop the call and notify the filter's listener, which answers it
    /// (`SECCOMP_RET_USER_NOTIF`; see [`crate::monitor_profile`]).
    Notify,
}

impl Action {
    /// The 32-bit `SECCOMP_RET_*` value a BPF `ret` returns for this action.
    pub fn ret_value(self) -> u32 {
        match self {
            Action::Allow => 0x7fff_0000,
            Action::Errno(errno) => 0x0005_0000 | u32::from(errno),
            Action::KillProcess => 0x8000_0000,
            Action::KillThread => 0x0000_0000,
            Action::Trap => 0x0003_0000,
            Action::Log => 0x7ffc_0000,
            Action::Notify => 0x7fc0_0000,
        }
    }

    /// Decode a `SECCOMP_RET_*` value (the inverse of [`Action::ret_value`]).
    pub fn from_ret_value(value: u32) -> Option<Action> {
        let data = (value & 0xffff) as u16;
        match value & 0xffff_0000 {
            0x7fff_0000 if data == 0 => Some(Action::Allow),
            0x0005_0000 => Some(Action::Errno(data)),
            0x8000_0000 if data == 0 => Some(Action::KillProcess),
            0x0000_0000 if data == 0 => Some(Action::KillThread),
            0x0003_0000 if data == 0 => Some(Action::Trap),
            0x7ffc_0000 if data == 0 => Some(Action::Log),
            0x7fc0_0000 if data == 0 => Some(Action::Notify),
            _ => None,
        }
    }

    /// Why the action cannot be encoded (errno above 4095), if it cannot.
    fn problem(self) -> Option<String> {
        match self {
            Action::Errno(errno) if errno > MAX_ERRNO => {
                Some(format!("errno {errno} is out of range 0..={MAX_ERRNO}"))
            }
            _ => None,
        }
    }

    /// Check the action can be encoded (errno within 0..=4095).
    pub(crate) fn validate(self) -> Result<(), SeccompError> {
        match self.problem() {
            Some(message) => Err(SeccompError::InvalidAction {
                action: format!("{self:?}"),
                message,
            }),
            None => Ok(()),
        }
    }
}

/// How an argument is compared with a [`ArgCondition::value`]; all comparisons are
/// unsigned and on the full 64 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CmpOp {
    /// `arg == value`
    Eq,
    /// `arg != value`
    Ne,
    /// `arg < value`
    Lt,
    /// `arg <= value`
    Le,
    /// `arg > value`
    Gt,
    /// `arg >= value`
    Ge,
    /// `arg & mask == value` (a `value` with bits outside `mask` never matches).
    ///
    /// A mask of `0xffff_ffff` compares only the low 32 bits, which is what a check on
    /// an `int` argument needs (the kernel ignores the register's upper half).
    MaskedEq(u64),
}

/// One condition on one syscall argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ArgCondition {
    /// Argument index, 0..=5.
    pub arg: u8,
    /// Comparison.
    pub op: CmpOp,
    /// Right-hand side of the comparison.
    pub value: u64,
}

impl ArgCondition {
    /// `arg(index) <op> value`.
    pub fn new(arg: u8, op: CmpOp, value: u64) -> Self {
        ArgCondition { arg, op, value }
    }
}

/// One rule: when syscall `syscall` is called and every condition holds, take `action`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Rule {
    /// x86_64 syscall number.
    pub syscall: u32,
    /// Decision when the rule matches.
    pub action: Action,
    /// Conditions, all of which must hold (empty: the rule always matches).
    pub conditions: Vec<ArgCondition>,
}

impl Rule {
    /// An unconditional rule for syscall number `syscall`.
    pub fn new(syscall: u32, action: Action) -> Self {
        Rule {
            syscall,
            action,
            conditions: Vec::new(),
        }
    }

    /// An unconditional rule for the x86_64 syscall called `name`; `None` if x86_64 has
    /// no syscall of that name.
    pub fn named(name: &str, action: Action) -> Option<Self> {
        sysno::syscall_number(name).map(|nr| Rule::new(nr, action))
    }

    /// Add a condition (conditions are ANDed).
    #[must_use]
    pub fn when(mut self, arg: u8, op: CmpOp, value: u64) -> Self {
        self.conditions.push(ArgCondition::new(arg, op, value));
        self
    }
}

/// A complete filter description, ready for [`Profile::compile`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Profile {
    /// Decision when no rule matches.
    pub default_action: Action,
    /// Decision for x32-ABI calls (syscall numbers with bit `0x4000_0000`), which are
    /// never matched against the rules.
    pub x32_action: Action,
    /// Rules, in priority order for any one syscall.
    pub rules: Vec<Rule>,
}

impl Profile {
    /// An empty profile. The x32 action is the default action, except that an
    /// allow-by-default profile blocks x32 calls with `EPERM` (the x32 ABI is a second
    /// syscall table a deny list would not cover).
    pub fn new(default_action: Action) -> Self {
        let x32_action = match default_action {
            Action::Allow | Action::Log => Action::Errno(EPERM),
            other => other,
        };
        Profile {
            default_action,
            x32_action,
            rules: Vec::new(),
        }
    }

    /// Append a rule (builder style).
    #[must_use]
    pub fn with_rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Append a rule.
    pub fn push(&mut self, rule: Rule) {
        self.rules.push(rule);
    }

    /// Check every rule and action can be encoded: argument indices 0..=5, errno
    /// values 0..=4095, syscall numbers without the x32 bit. [`Profile::compile`]
    /// calls this first.
    pub fn validate(&self) -> Result<(), SeccompError> {
        self.default_action.validate()?;
        self.x32_action.validate()?;
        for (index, rule) in self.rules.iter().enumerate() {
            let err = |message: String| SeccompError::InvalidRule {
                index,
                syscall: sysno::display_name(rule.syscall),
                message,
            };
            if rule.syscall >= X32_SYSCALL_BIT {
                return Err(err(format!(
                    "syscall number {:#x} is not a native x86_64 number (x32 calls are handled by x32_action)",
                    rule.syscall
                )));
            }
            if let Some(problem) = rule.action.problem() {
                return Err(err(problem));
            }
            if let Some(cond) = rule.conditions.iter().find(|c| c.arg > 5) {
                return Err(err(format!(
                    "argument index {} is out of range 0..=5",
                    cond.arg
                )));
            }
        }
        Ok(())
    }
}

/// Bit that marks an x32-ABI syscall number on x86_64 (`__X32_SYSCALL_BIT`).
pub const X32_SYSCALL_BIT: u32 = 0x4000_0000;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ret_values_round_trip() {
        for action in [
            Action::Allow,
            Action::Errno(EPERM),
            Action::Errno(MAX_ERRNO),
            Action::KillProcess,
            Action::KillThread,
            Action::Trap,
            Action::Log,
            Action::Notify,
        ] {
            assert_eq!(Action::from_ret_value(action.ret_value()), Some(action));
        }
    }

    #[test]
    fn x32_action_follows_default() {
        assert_eq!(Profile::new(Action::Allow).x32_action, Action::Errno(EPERM));
        assert_eq!(
            Profile::new(Action::Errno(13)).x32_action,
            Action::Errno(13)
        );
        assert_eq!(
            Profile::new(Action::KillProcess).x32_action,
            Action::KillProcess
        );
    }

    #[test]
    fn validate_rejects_bad_rules() {
        let p = Profile::new(Action::Allow).with_rule(Rule::new(0, Action::Allow).when(
            6,
            CmpOp::Eq,
            0,
        ));
        let e = p.validate().unwrap_err().to_string();
        assert_eq!(
            e,
            "seccomp rule 0 (syscall read): argument index 6 is out of range 0..=5"
        );

        let p = Profile::new(Action::Allow).with_rule(Rule::new(1, Action::Errno(5000)));
        assert!(p
            .validate()
            .unwrap_err()
            .to_string()
            .contains("errno 5000 is out of range 0..=4095"));

        let p = Profile::new(Action::Errno(4096));
        assert!(p.validate().is_err());

        let p =
            Profile::new(Action::Allow).with_rule(Rule::new(X32_SYSCALL_BIT | 1, Action::Allow));
        assert!(p.validate().unwrap_err().to_string().contains("x32"));
    }
}
