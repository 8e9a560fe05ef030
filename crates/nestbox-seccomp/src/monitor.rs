//! The second filter of a box run under monitors (`nestbox run --monitor`):
//! every call a monitor subscribes to stops and waits for the monitors'
//! answer on the filter's listener ([`Action::Notify`]); every other call
//! goes on at once to the box's own filter, which still decides it.
//!
//! One exception is built in: the box's first process hands the listener to
//! its monitor with one `sendmsg` that carries a 128-bit random cookie in its
//! unused arguments 3 and 4 (as the setns cookie does). That call is let
//! through even when `sendmsg` is subscribed: nobody could answer it yet. No
//! program in the box can guess the cookie.

use crate::profile::{Action, ArgCondition, CmpOp, Profile, Rule};

/// The x86_64 number of `sendmsg`.
const SENDMSG: u32 = 46;

/// The monitor filter for `syscalls` (x86_64 numbers), with the hand-over
/// `sendmsg` allowed when its arguments 3 and 4 are `cookie`.
pub fn monitor_profile(syscalls: &[u32], cookie: [u64; 2]) -> Profile {
    let mut p = Profile::new(Action::Allow);
    p.rules.push(Rule {
        syscall: SENDMSG,
        action: Action::Allow,
        conditions: vec![
            ArgCondition::new(3, CmpOp::Eq, cookie[0]),
            ArgCondition::new(4, CmpOp::Eq, cookie[1]),
        ],
    });
    let mut seen = std::collections::BTreeSet::new();
    for &nr in syscalls {
        if seen.insert(nr) {
            p.rules.push(Rule::new(nr, Action::Notify));
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Data};
    use crate::syscall_number;

    #[test]
    fn subscribed_calls_notify_others_pass_and_the_handover_passes() {
        let nr = |n: &str| syscall_number(n).unwrap();
        let cookie = [0x1122_3344_5566_7788, 0x99aa_bbcc_ddee_ff00];
        let prog = monitor_profile(&[nr("openat"), nr("sendmsg"), nr("openat")], cookie)
            .compile()
            .unwrap();
        let call = |name: &str, args: [u64; 6]| run(&prog, &Data::x86_64(nr(name), args));
        assert_eq!(call("openat", [0; 6]), Action::Notify);
        assert_eq!(call("read", [0; 6]), Action::Allow);
        assert_eq!(call("sendmsg", [5, 0, 0, 0, 0, 0]), Action::Notify);
        assert_eq!(
            call("sendmsg", [5, 0, 0, cookie[0], cookie[1], 0]),
            Action::Allow
        );
        assert_eq!(
            call("sendmsg", [5, 0, 0, cookie[0], 7, 0]),
            Action::Notify,
            "half the cookie is no cookie"
        );
    }
}
