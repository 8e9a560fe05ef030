//! The x86_64 syscall name <-> number table.
//!
//! Backed by the `syscalls` crate's generated x86_64 table, so names follow the
//! kernel's `syscall_64.tbl` spelling (`_sysctl`, `umount2`, `clone3`, ...). Names that
//! exist only on other architectures (`umount`, `stime`, `vm86`, `mmap2`, ...) are not
//! in it: lookups return `None` and callers skip them, as libseccomp does.

use std::str::FromStr;

use syscalls::x86_64::Sysno;

/// Number of the x86_64 syscall called `name`, or `None` if x86_64 has no such call.
pub fn syscall_number(name: &str) -> Option<u32> {
    let sysno = Sysno::from_str(name).ok()?;
    u32::try_from(sysno.id()).ok()
}

/// Name of the x86_64 syscall numbered `nr`, or `None` if the table has no entry.
pub fn syscall_name(nr: u32) -> Option<&'static str> {
    let id = usize::try_from(nr).ok()?;
    Sysno::new(id).map(|s| s.name())
}

/// Name of syscall `nr` for messages: its name, or `#nr` when unknown.
pub(crate) fn display_name(nr: u32) -> String {
    syscall_name(nr).map_or_else(|| format!("#{nr}"), str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_names_round_trip() {
        for (name, nr) in [
            ("read", 0),
            ("mount", 165),
            ("clone", 56),
            ("clone3", 435),
            ("_sysctl", 156),
        ] {
            assert_eq!(syscall_number(name), Some(nr), "{name}");
            assert_eq!(syscall_name(nr), Some(name));
        }
    }

    #[test]
    fn other_arch_names_are_unknown() {
        for name in [
            "umount",
            "stime",
            "vm86",
            "vm86old",
            "mmap2",
            "socketcall",
            "no_such_call",
        ] {
            assert_eq!(syscall_number(name), None, "{name}");
        }
        assert_eq!(display_name(100_000), "#100000");
    }
}
