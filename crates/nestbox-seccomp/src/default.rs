//! nestbox's default filter for boxes: allow by default, deny a fixed list.
//!
//! The list covers everything Docker's default profile (moby `profiles/seccomp`)
//! refuses on x86_64, reviewed syscall by syscall, and mirrors Docker's capability
//! gating: a call Docker permits only when a capability is added is permitted here
//! when that capability is in the box's set ([`DefaultOpts`]). Where nestbox is
//! stricter than Docker it says so in `docs/seccomp.md`:
//! * `ptrace`, `process_vm_readv`, `process_vm_writev` are blocked unless the box has
//!   `CAP_SYS_PTRACE` (Docker permits them on kernels >= 4.8);
//! * `name_to_handle_at` is gated like `open_by_handle_at` (`CAP_DAC_READ_SEARCH`);
//! * `socket(AF_ALG | AF_VSOCK)` is checked on the low 32 bits of the family, which
//!   is all the kernel looks at;
//! * i386 (`int 0x80`) calls kill the process and x32 calls fail with `EPERM`.
//!
//! Names absent from the x86_64 table (`umount`, `stime`, `vm86`, ...) are listed
//! for completeness and skipped when the profile is built.

use crate::profile::{Action, CmpOp, Profile, Rule, ENOSYS, EPERM};
use crate::sysno::syscall_number;

use Capability as C;

/// A capability that, when the box holds it, re-enables some blocked syscalls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Capability {
    /// `CAP_SYS_ADMIN`: mounts, namespaces, `bpf`, `perf_event_open`, ...
    SysAdmin,
    /// `CAP_SYS_BOOT`: `reboot`.
    SysBoot,
    /// `CAP_SYS_CHROOT`: `chroot`.
    SysChroot,
    /// `CAP_SYS_MODULE`: loading and unloading kernel modules.
    SysModule,
    /// `CAP_SYS_NICE`: NUMA memory policy calls.
    SysNice,
    /// `CAP_SYS_PACCT`: `acct`.
    SysPacct,
    /// `CAP_SYS_PTRACE`: `ptrace` and the other cross-process inspection calls.
    SysPtrace,
    /// `CAP_SYS_RAWIO`: `iopl`, `ioperm`.
    SysRawio,
    /// `CAP_SYS_TIME`: setting the system clock.
    SysTime,
    /// `CAP_SYS_TTY_CONFIG`: `vhangup`.
    SysTtyConfig,
    /// `CAP_SYSLOG`: `syslog`.
    Syslog,
    /// `CAP_DAC_READ_SEARCH`: `open_by_handle_at`, `name_to_handle_at`.
    DacReadSearch,
    /// `CAP_BPF`: `bpf`.
    Bpf,
    /// `CAP_PERFMON`: `perf_event_open`.
    Perfmon,
}

impl Capability {
    /// Every capability the default profile looks at.
    pub const ALL: [Capability; 14] = [
        Capability::SysAdmin,
        Capability::SysBoot,
        Capability::SysChroot,
        Capability::SysModule,
        Capability::SysNice,
        Capability::SysPacct,
        Capability::SysPtrace,
        Capability::SysRawio,
        Capability::SysTime,
        Capability::SysTtyConfig,
        Capability::Syslog,
        Capability::DacReadSearch,
        Capability::Bpf,
        Capability::Perfmon,
    ];

    /// The kernel's name, e.g. `CAP_SYS_ADMIN`.
    pub fn name(self) -> &'static str {
        match self {
            Capability::SysAdmin => "CAP_SYS_ADMIN",
            Capability::SysBoot => "CAP_SYS_BOOT",
            Capability::SysChroot => "CAP_SYS_CHROOT",
            Capability::SysModule => "CAP_SYS_MODULE",
            Capability::SysNice => "CAP_SYS_NICE",
            Capability::SysPacct => "CAP_SYS_PACCT",
            Capability::SysPtrace => "CAP_SYS_PTRACE",
            Capability::SysRawio => "CAP_SYS_RAWIO",
            Capability::SysTime => "CAP_SYS_TIME",
            Capability::SysTtyConfig => "CAP_SYS_TTY_CONFIG",
            Capability::Syslog => "CAP_SYSLOG",
            Capability::DacReadSearch => "CAP_DAC_READ_SEARCH",
            Capability::Bpf => "CAP_BPF",
            Capability::Perfmon => "CAP_PERFMON",
        }
    }

    /// Parse a capability name, case-insensitively, with or without the `CAP_`
    /// prefix (`CAP_SYS_ADMIN`, `sys_admin`). `None` for capabilities the default
    /// profile does not look at (and for non-capabilities).
    pub fn from_name(name: &str) -> Option<Capability> {
        let upper = name.trim().to_ascii_uppercase();
        let full = if upper.starts_with("CAP_") {
            upper
        } else {
            format!("CAP_{upper}")
        };
        Capability::ALL.into_iter().find(|c| c.name() == full)
    }
}

/// Which capabilities the box was given, as far as the default filter cares.
/// All `false` ([`Default`]) is the strictest filter.
///
/// Mirror the box's real bounding set here: for example a runtime that, like Docker,
/// gives boxes `CAP_SYS_CHROOT` by default must set `sys_chroot`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DefaultOpts {
    /// `CAP_SYS_ADMIN`.
    pub sys_admin: bool,
    /// `CAP_SYS_BOOT`.
    pub sys_boot: bool,
    /// `CAP_SYS_CHROOT`.
    pub sys_chroot: bool,
    /// `CAP_SYS_MODULE`.
    pub sys_module: bool,
    /// `CAP_SYS_NICE`.
    pub sys_nice: bool,
    /// `CAP_SYS_PACCT`.
    pub sys_pacct: bool,
    /// `CAP_SYS_PTRACE`.
    pub sys_ptrace: bool,
    /// `CAP_SYS_RAWIO`.
    pub sys_rawio: bool,
    /// `CAP_SYS_TIME`.
    pub sys_time: bool,
    /// `CAP_SYS_TTY_CONFIG`.
    pub sys_tty_config: bool,
    /// `CAP_SYSLOG`.
    pub syslog: bool,
    /// `CAP_DAC_READ_SEARCH`.
    pub dac_read_search: bool,
    /// `CAP_BPF`.
    pub bpf: bool,
    /// `CAP_PERFMON`.
    pub perfmon: bool,
    /// The box runs boxes of its own (`run --nest`, in a user namespace):
    /// the calls in [`NEST_ALLOWED`] and namespace-creating `clone`/`clone3`
    /// are let through, for the kernel to check against the box's user
    /// namespace (see `docs/nesting.md`).
    pub nest: bool,
}

impl DefaultOpts {
    /// Options for a box holding the named capabilities (see
    /// [`Capability::from_name`]); names the filter does not care about are ignored.
    pub fn from_capability_names<I, S>(names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut opts = DefaultOpts::default();
        for cap in names
            .into_iter()
            .filter_map(|n| Capability::from_name(n.as_ref()))
        {
            *opts.flag_mut(cap) = true;
        }
        opts
    }

    /// Builder: mark `cap` as held.
    #[must_use]
    pub fn with(mut self, cap: Capability) -> Self {
        *self.flag_mut(cap) = true;
        self
    }

    /// Whether the box holds `cap`.
    pub fn has(&self, cap: Capability) -> bool {
        match cap {
            Capability::SysAdmin => self.sys_admin,
            Capability::SysBoot => self.sys_boot,
            Capability::SysChroot => self.sys_chroot,
            Capability::SysModule => self.sys_module,
            Capability::SysNice => self.sys_nice,
            Capability::SysPacct => self.sys_pacct,
            Capability::SysPtrace => self.sys_ptrace,
            Capability::SysRawio => self.sys_rawio,
            Capability::SysTime => self.sys_time,
            Capability::SysTtyConfig => self.sys_tty_config,
            Capability::Syslog => self.syslog,
            Capability::DacReadSearch => self.dac_read_search,
            Capability::Bpf => self.bpf,
            Capability::Perfmon => self.perfmon,
        }
    }

    fn flag_mut(&mut self, cap: Capability) -> &mut bool {
        match cap {
            Capability::SysAdmin => &mut self.sys_admin,
            Capability::SysBoot => &mut self.sys_boot,
            Capability::SysChroot => &mut self.sys_chroot,
            Capability::SysModule => &mut self.sys_module,
            Capability::SysNice => &mut self.sys_nice,
            Capability::SysPacct => &mut self.sys_pacct,
            Capability::SysPtrace => &mut self.sys_ptrace,
            Capability::SysRawio => &mut self.sys_rawio,
            Capability::SysTime => &mut self.sys_time,
            Capability::SysTtyConfig => &mut self.sys_tty_config,
            Capability::Syslog => &mut self.syslog,
            Capability::DacReadSearch => &mut self.dac_read_search,
            Capability::Bpf => &mut self.bpf,
            Capability::Perfmon => &mut self.perfmon,
        }
    }
}

/// What a box that runs boxes of its own (`DefaultOpts::nest`) may call
/// although the default profile blocks it: making namespaces and mounting
/// in them (the kernel allows either only in namespaces owned by a user
/// namespace the caller made or holds, so a box can mount nothing of its
/// parent's), `pivot_root` into a nested box's root, and the cross-process
/// calls `freeze`/`clone` use on the nested boxes' processes (limited by
/// the kernel to processes of the caller's own user namespaces).
pub const NEST_ALLOWED: &[&str] = &[
    "mount",
    "umount2",
    "mount_setattr",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "setns",
    "unshare",
    "sethostname",
    "setdomainname",
    "pivot_root",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
];

/// One group of unconditionally blocked syscalls.
#[derive(Debug, Clone, Copy)]
pub struct Blocked {
    /// Syscall names (some may not exist on x86_64; those are skipped).
    pub names: &'static [&'static str],
    /// Errno returned.
    pub errno: u16,
    /// Holding any of these capabilities re-enables the group (empty: never).
    pub unless: &'static [Capability],
}

const fn block(names: &'static [&'static str], unless: &'static [Capability]) -> Blocked {
    Blocked {
        names,
        errno: EPERM,
        unless,
    }
}

/// Syscalls the default profile blocks whatever their arguments. The reasons are in
/// `docs/seccomp.md`. Argument-dependent blocks are separate: see
/// [`ARGUMENT_FILTERED`].
pub const BLOCKED: &[Blocked] = &[
    // Mount table and namespaces (escape / host mount manipulation).
    block(
        &[
            "mount",
            "umount",
            "umount2",
            "mount_setattr",
            "move_mount",
            "open_tree",
            "open_tree_attr",
            "fsopen",
            "fsconfig",
            "fsmount",
            "fspick",
            "setns",
            "unshare",
            "sethostname",
            "setdomainname",
            "quotactl",
            "quotactl_fd",
            "lookup_dcookie",
            "fanotify_init",
            "lsm_get_self_attr",
            "lsm_set_self_attr",
            "lsm_list_modules",
        ],
        &[C::SysAdmin],
    ),
    block(&["pivot_root"], &[]),
    // Kernel attack surface and host-wide observation.
    block(&["bpf"], &[C::SysAdmin, C::Bpf]),
    block(&["perf_event_open"], &[C::SysAdmin, C::Perfmon]),
    block(&["syslog"], &[C::SysAdmin, C::Syslog]),
    block(&["userfaultfd"], &[]),
    block(
        &["io_uring_setup", "io_uring_enter", "io_uring_register"],
        &[],
    ),
    block(&["add_key", "keyctl", "request_key"], &[]),
    // Kernel modules and replacing the kernel.
    block(
        &["init_module", "finit_module", "delete_module"],
        &[C::SysModule],
    ),
    block(&["create_module", "get_kernel_syms", "query_module"], &[]),
    block(&["reboot"], &[C::SysBoot]),
    block(&["kexec_load", "kexec_file_load"], &[]),
    // Host-global state.
    block(&["settimeofday", "clock_settime", "stime"], &[C::SysTime]),
    block(&["acct"], &[C::SysPacct]),
    block(&["swapon", "swapoff"], &[]),
    block(&["vhangup"], &[C::SysTtyConfig]),
    block(&["iopl", "ioperm"], &[C::SysRawio]),
    block(
        &[
            "get_mempolicy",
            "set_mempolicy",
            "mbind",
            "set_mempolicy_home_node",
        ],
        &[C::SysNice],
    ),
    block(&["move_pages", "migrate_pages"], &[]),
    // Reaching into other processes.
    block(
        &[
            "ptrace",
            "process_vm_readv",
            "process_vm_writev",
            "kcmp",
            "pidfd_getfd",
            "process_madvise",
        ],
        &[C::SysPtrace],
    ),
    // Filesystem escapes.
    block(
        &["open_by_handle_at", "name_to_handle_at"],
        &[C::DacReadSearch],
    ),
    block(&["chroot"], &[C::SysChroot]),
    // Obsolete, unimplemented or legacy interfaces.
    block(
        &[
            "_sysctl",
            "sysfs",
            "ustat",
            "uselib",
            "nfsservctl",
            "vm86",
            "vm86old",
        ],
        &[],
    ),
    block(
        &[
            "afs_syscall",
            "getpmsg",
            "putpmsg",
            "security",
            "tuxcall",
            "vserver",
        ],
        &[],
    ),
    // Newer than Docker's reviewed list: look unimplemented so callers fall back.
    Blocked {
        names: &["file_getattr", "file_setattr", "uprobe"],
        errno: ENOSYS,
        unless: &[],
    },
];

/// Syscalls the default profile filters on their arguments (see
/// [`default_profile`]): `clone` (namespace flags), `clone3` (always `ENOSYS`),
/// `personality` (unsafe personas) and `socket` (`AF_ALG`, `AF_VSOCK`).
pub const ARGUMENT_FILTERED: &[&str] = &["clone", "clone3", "personality", "socket"];

/// `CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER |
/// CLONE_NEWPID | CLONE_NEWNET`: the `clone` flags that create namespaces.
pub const CLONE_NAMESPACE_FLAGS: u64 = 0x7e02_0000;

/// `personality` values a box may set: `PER_LINUX`, `PER_LINUX32`,
/// `UNAME26`, `PER_LINUX32|UNAME26`, and `0xffffffff` (query only).
pub const SAFE_PERSONAS: [u64; 5] = [0x0, 0x8, 0x2_0000, 0x2_0008, 0xffff_ffff];

/// `AF_ALG` and `AF_VSOCK`: socket families a box may not open.
pub const BLOCKED_SOCKET_FAMILIES: [u64; 2] = [38, 40];

/// Every syscall name the default profile can block, for documentation and tests.
pub fn blocked_syscall_names() -> impl Iterator<Item = &'static str> {
    BLOCKED
        .iter()
        .flat_map(|b| b.names.iter().copied())
        .chain(ARGUMENT_FILTERED.iter().copied())
}

/// Build nestbox's default profile for a box holding the capabilities in `opts`.
///
/// Default action `Allow`; x32 calls get `EPERM`; foreign-architecture calls kill the
/// process. Besides [`BLOCKED`]:
/// * `clone` with any of [`CLONE_NAMESPACE_FLAGS`] in its flags (argument 0 on
///   x86_64) fails with `EPERM`, unless `sys_admin`;
/// * `clone3` fails with `ENOSYS`, unless `sys_admin`: its flags sit in a struct
///   BPF cannot read, and `ENOSYS` makes libc fall back to `clone`;
/// * `personality` only accepts [`SAFE_PERSONAS`], otherwise `EPERM`;
/// * `socket` with family `AF_ALG` or `AF_VSOCK` fails with `EPERM`.
pub fn default_profile(opts: DefaultOpts) -> Profile {
    let mut p = Profile::new(Action::Allow);
    // All four are in the x86_64 table; `if let` keeps the "unknown names are
    // skipped" rule uniform anyway.
    if let (false, Some(clone), Some(clone3)) = (
        opts.sys_admin || opts.nest,
        syscall_number("clone"),
        syscall_number("clone3"),
    ) {
        p.push(Rule::new(clone, Action::Allow).when(0, CmpOp::MaskedEq(CLONE_NAMESPACE_FLAGS), 0));
        p.push(Rule::new(clone, Action::Errno(EPERM)));
        p.push(Rule::new(clone3, Action::Errno(ENOSYS)));
    }
    if let Some(personality) = syscall_number("personality") {
        for persona in SAFE_PERSONAS {
            p.push(Rule::new(personality, Action::Allow).when(0, CmpOp::Eq, persona));
        }
        p.push(Rule::new(personality, Action::Errno(EPERM)));
    }
    if let Some(socket) = syscall_number("socket") {
        for family in BLOCKED_SOCKET_FAMILIES {
            // `int family`: the kernel ignores the register's upper half, so must we.
            p.push(Rule::new(socket, Action::Errno(EPERM)).when(
                0,
                CmpOp::MaskedEq(0xffff_ffff),
                family,
            ));
        }
    }
    for group in BLOCKED {
        if group.unless.iter().any(|&cap| opts.has(cap)) {
            continue;
        }
        for nr in group
            .names
            .iter()
            .filter(|name| !(opts.nest && NEST_ALLOWED.contains(name)))
            .filter_map(|name| syscall_number(name))
        {
            p.push(Rule::new(nr, Action::Errno(group.errno)));
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf::Program;
    use crate::interp::{run, Data};
    use crate::profile::X32_SYSCALL_BIT;

    const CLONE_VM: u64 = 0x100;
    const CLONE_FS: u64 = 0x200;
    const CLONE_FILES: u64 = 0x400;
    const CLONE_SIGHAND: u64 = 0x800;
    const CLONE_THREAD: u64 = 0x1_0000;
    const CLONE_SYSVSEM: u64 = 0x4_0000;
    const CLONE_SETTLS: u64 = 0x8_0000;
    const CLONE_PARENT_SETTID: u64 = 0x10_0000;
    const CLONE_CHILD_CLEARTID: u64 = 0x20_0000;
    const CLONE_NEWUSER: u64 = 0x1000_0000;
    const CLONE_NEWNET: u64 = 0x4000_0000;
    const CLONE_NEWNS: u64 = 0x2_0000;
    const SIGCHLD: u64 = 17;
    /// What glibc's `pthread_create` passes.
    const THREAD_FLAGS: u64 = CLONE_VM
        | CLONE_FS
        | CLONE_FILES
        | CLONE_SIGHAND
        | CLONE_THREAD
        | CLONE_SYSVSEM
        | CLONE_SETTLS
        | CLONE_PARENT_SETTID
        | CLONE_CHILD_CLEARTID;

    fn prog(opts: DefaultOpts) -> Program {
        default_profile(opts).compile().unwrap()
    }

    fn call(p: &Program, name: &str, args: [u64; 6]) -> Action {
        run(p, &Data::x86_64(syscall_number(name).unwrap(), args))
    }

    fn arg0(v: u64) -> [u64; 6] {
        [v, 0, 0, 0, 0, 0]
    }

    #[test]
    fn ordinary_calls_are_allowed() {
        let p = prog(DefaultOpts::default());
        for name in [
            "read",
            "write",
            "openat",
            "mmap",
            "getpid",
            "execve",
            "exit_group",
            "clock_adjtime",
            "uretprobe",
        ] {
            assert_eq!(call(&p, name, [0; 6]), Action::Allow, "{name}");
        }
        // Numbers beyond the table (future syscalls) follow the default.
        assert_eq!(run(&p, &Data::x86_64(600, [0; 6])), Action::Allow);
    }

    #[test]
    fn blocked_calls_get_eperm() {
        let p = prog(DefaultOpts::default());
        for name in [
            "mount",
            "umount2",
            "pivot_root",
            "unshare",
            "setns",
            "bpf",
            "ptrace",
            "keyctl",
            "kexec_load",
        ] {
            assert_eq!(call(&p, name, [0; 6]), Action::Errno(EPERM), "{name}");
        }
        for name in [
            "io_uring_setup",
            "userfaultfd",
            "perf_event_open",
            "open_by_handle_at",
            "_sysctl",
            "chroot",
        ] {
            assert_eq!(call(&p, name, [0; 6]), Action::Errno(EPERM), "{name}");
        }
        assert_eq!(call(&p, "file_setattr", [0; 6]), Action::Errno(ENOSYS));
    }

    #[test]
    fn every_listed_x86_64_syscall_is_blocked_without_caps() {
        let p = prog(DefaultOpts::default());
        for group in BLOCKED {
            for name in group.names.iter().filter(|n| syscall_number(n).is_some()) {
                assert_eq!(call(&p, name, [0; 6]), Action::Errno(group.errno), "{name}");
            }
        }
    }

    #[test]
    fn clone_namespace_flags() {
        let p = prog(DefaultOpts::default());
        assert_eq!(call(&p, "clone", arg0(THREAD_FLAGS)), Action::Allow);
        assert_eq!(call(&p, "clone", arg0(SIGCHLD)), Action::Allow);
        assert_eq!(
            call(&p, "clone", arg0(CLONE_NEWUSER | SIGCHLD)),
            Action::Errno(EPERM)
        );
        assert_eq!(call(&p, "clone", arg0(CLONE_NEWNET)), Action::Errno(EPERM));
        assert_eq!(
            call(&p, "clone", arg0(CLONE_NEWNS | THREAD_FLAGS)),
            Action::Errno(EPERM)
        );
        // The kernel only looks at the low 32 bits of the flags; so does the filter.
        assert_eq!(
            call(&p, "clone", arg0(0xffff_ffff_0000_0000 | SIGCHLD)),
            Action::Allow
        );
        assert_eq!(
            call(&p, "clone", arg0(0xffff_ffff_0000_0000 | CLONE_NEWUSER)),
            Action::Errno(EPERM)
        );
        assert_eq!(call(&p, "clone3", [0; 6]), Action::Errno(ENOSYS));
    }

    #[test]
    fn personality_personas() {
        let p = prog(DefaultOpts::default());
        for persona in SAFE_PERSONAS {
            assert_eq!(
                call(&p, "personality", arg0(persona)),
                Action::Allow,
                "{persona:#x}"
            );
        }
        // ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC, and a safe value with junk above bit 32.
        for persona in [0x004_0000, 0x040_0000, 0x1_0000_0000] {
            assert_eq!(
                call(&p, "personality", arg0(persona)),
                Action::Errno(EPERM),
                "{persona:#x}"
            );
        }
    }

    #[test]
    fn socket_families() {
        let p = prog(DefaultOpts::default());
        for family in [1u64, 2, 10, 16, 39, 41, 45] {
            assert_eq!(call(&p, "socket", arg0(family)), Action::Allow, "{family}");
        }
        for family in [38u64, 40, 0x1_0000_0026] {
            assert_eq!(
                call(&p, "socket", arg0(family)),
                Action::Errno(EPERM),
                "{family:#x}"
            );
        }
    }

    #[test]
    fn arch_and_x32() {
        let p = prog(DefaultOpts::default());
        let mut d = Data::x86_64(0, [0; 6]);
        d.arch = 0x4000_0003; // AUDIT_ARCH_I386
        assert_eq!(run(&p, &d), Action::KillProcess);
        let x32_read = X32_SYSCALL_BIT;
        assert_eq!(
            run(&p, &Data::x86_64(x32_read, [0; 6])),
            Action::Errno(EPERM)
        );
    }

    #[test]
    fn a_nest_box_may_make_namespaces_and_mount_but_nothing_more() {
        let nest = prog(DefaultOpts {
            nest: true,
            ..Default::default()
        });
        for name in NEST_ALLOWED {
            assert_eq!(call(&nest, name, [0; 6]), Action::Allow, "{name}");
        }
        assert_eq!(
            call(&nest, "clone", arg0(CLONE_NEWUSER | CLONE_NEWNS)),
            Action::Allow
        );
        assert_eq!(call(&nest, "clone3", [0; 6]), Action::Allow);
        for name in [
            "bpf",
            "keyctl",
            "userfaultfd",
            "init_module",
            "kexec_load",
            "open_by_handle_at",
            "io_uring_setup",
            "perf_event_open",
        ] {
            assert_eq!(call(&nest, name, [0; 6]), Action::Errno(EPERM), "{name}");
        }
        // Without it, all of them stay blocked.
        let plain = prog(DefaultOpts::default());
        for name in NEST_ALLOWED {
            assert_ne!(call(&plain, name, [0; 6]), Action::Allow, "{name}");
        }
    }

    #[test]
    fn capabilities_reenable_their_calls() {
        let admin = prog(DefaultOpts {
            sys_admin: true,
            ..Default::default()
        });
        for name in [
            "mount",
            "umount2",
            "unshare",
            "setns",
            "bpf",
            "perf_event_open",
            "syslog",
            "fsopen",
        ] {
            assert_eq!(call(&admin, name, [0; 6]), Action::Allow, "{name}");
        }
        assert_eq!(call(&admin, "clone", arg0(CLONE_NEWUSER)), Action::Allow);
        assert_eq!(call(&admin, "clone3", [0; 6]), Action::Allow);
        // Never re-enabled, even with CAP_SYS_ADMIN.
        for name in [
            "pivot_root",
            "kexec_load",
            "keyctl",
            "swapon",
            "io_uring_setup",
            "userfaultfd",
        ] {
            assert_eq!(call(&admin, name, [0; 6]), Action::Errno(EPERM), "{name}");
        }
        assert_eq!(call(&admin, "ptrace", [0; 6]), Action::Errno(EPERM));

        for cap in Capability::ALL {
            let p = prog(DefaultOpts::default().with(cap));
            for group in BLOCKED.iter().filter(|g| g.unless.contains(&cap)) {
                for name in group.names.iter().filter(|n| syscall_number(n).is_some()) {
                    assert_eq!(
                        call(&p, name, [0; 6]),
                        Action::Allow,
                        "{name} with {}",
                        cap.name()
                    );
                }
            }
        }
        let p = prog(DefaultOpts::from_capability_names([
            "CAP_SYS_PTRACE",
            "cap_chown",
            "sys_time",
        ]));
        assert_eq!(call(&p, "ptrace", [0; 6]), Action::Allow);
        assert_eq!(call(&p, "process_vm_readv", [0; 6]), Action::Allow);
        assert_eq!(call(&p, "clock_settime", [0; 6]), Action::Allow);
        assert_eq!(call(&p, "mount", [0; 6]), Action::Errno(EPERM));
    }

    #[test]
    fn capability_names() {
        assert_eq!(
            Capability::from_name("CAP_SYS_ADMIN"),
            Some(Capability::SysAdmin)
        );
        assert_eq!(
            Capability::from_name("sys_admin"),
            Some(Capability::SysAdmin)
        );
        assert_eq!(Capability::from_name("Syslog"), Some(Capability::Syslog));
        assert_eq!(Capability::from_name("CAP_CHOWN"), None);
        for cap in Capability::ALL {
            assert_eq!(Capability::from_name(cap.name()), Some(cap));
            assert!(DefaultOpts::default().with(cap).has(cap));
        }
    }

    #[test]
    fn program_fits_comfortably() {
        let p = prog(DefaultOpts::default());
        assert!(p.len() < 400, "default program is {} instructions", p.len());
    }

    /// docs/seccomp.md must document every syscall the default profile can block.
    #[test]
    fn docs_list_every_blocked_syscall() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/seccomp.md");
        let doc = std::fs::read_to_string(path).expect("docs/seccomp.md");
        for name in blocked_syscall_names() {
            assert!(
                doc.contains(&format!("`{name}`")),
                "docs/seccomp.md does not mention `{name}`"
            );
        }
    }
}
