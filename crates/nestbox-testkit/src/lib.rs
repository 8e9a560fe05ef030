//! Gates shared by every nestbox test suite.
//!
//! A test that cannot run where it is started (it needs root, a kernel file, a
//! package) calls one of these gates instead of returning early on its own. On a
//! developer's machine the gate prints `SKIP <test>: <why>` and the test returns;
//! under CI (`CI=true`, which `.ci/run` sets and which runs as root on a machine
//! prepared by `scripts/setup.sh`) the gate panics instead, so a test that did not
//! run can never be counted as passed there.

mod out;

pub use out::Out;

/// Whether the suite runs under CI (`CI=true`): every skip is then a failure.
pub fn under_ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// Whether the tests run as root (effective uid 0).
pub fn is_root() -> bool {
    // SAFETY: geteuid takes no arguments, has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// `test` cannot run here because of `why`: under CI this panics; otherwise
/// it prints `SKIP test: why` on stderr and the test should return.
///
/// # Panics
/// Under CI (`CI=true`).
pub fn skip(test: &str, why: &str) {
    skip_as(under_ci(), test, why);
}

fn skip_as(ci: bool, test: &str, why: &str) {
    if ci {
        panic!("{test}: cannot run here: {why} (under CI=true a skipped test is a failure)");
    }
    eprintln!("SKIP {test}: {why}");
}

/// True if `condition` holds and the test may go on; otherwise the test is
/// skipped for `why` (a failure under CI, see [`skip`]).
pub fn require(condition: bool, test: &str, why: &str) -> bool {
    if !condition {
        skip(test, why);
    }
    condition
}

/// True if the test runs as root and may go on; otherwise it is skipped (a
/// failure under CI). Tests that create cgroups, mounts, namespaces of other
/// users or network links need root.
pub fn require_root(test: &str) -> bool {
    require(
        is_root(),
        test,
        "needs root (namespaces, cgroups, mounts, links)",
    )
}

/// The `main` of a test binary whose cases share process-wide state (ptrace,
/// forks, the roles the binary is re-executed in) and so run one at a time on
/// the main thread, whatever `--test-threads` says: libtest's command line
/// (filters, `--skip`, `--exact`, `--list`) through libtest-mimic, each case
/// behind [`require_root`]. Exits with the run's status.
pub fn run_root_cases(cases: &[(&'static str, fn())]) -> ! {
    let mut args = libtest_mimic::Arguments::from_args();
    args.test_threads = Some(1);
    let trials = cases
        .iter()
        .map(|&(name, case)| {
            libtest_mimic::Trial::test(name, move || {
                if require_root(name) {
                    case();
                }
                Ok(())
            })
        })
        .collect();
    libtest_mimic::run(&args, trials).exit()
}

/// A port of the host that no TCP or UDP socket holds now, from
/// `lo..lo + span` (starting at an offset given by this test process's pid),
/// below the kernel's ephemeral range: a port in that range may be taken at
/// any moment as the local port of a connection (another test's), and
/// publishing it then fails with "already in use". Callers give each test a
/// range of its own.
pub fn unused_port(lo: u16, span: u16) -> u16 {
    let ephemeral_lo: u32 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    assert!(
        u32::from(lo) + u32::from(span) <= ephemeral_lo,
        "ports {lo}..{} reach into the ephemeral range (from {ephemeral_lo})",
        u32::from(lo) + u32::from(span)
    );
    let start = (std::process::id() % u32::from(span)) as u16;
    (0..span)
        .map(|i| lo + (start + i) % span)
        .find(|p| {
            std::net::TcpListener::bind(("0.0.0.0", *p)).is_ok()
                && std::net::UdpSocket::bind(("0.0.0.0", *p)).is_ok()
        })
        .unwrap_or_else(|| {
            panic!(
                "no unused port in {lo}..{}",
                u32::from(lo) + u32::from(span)
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn require_passes_a_condition_that_holds() {
        assert!(require(true, "t", "never printed"));
    }

    #[test]
    fn a_skip_under_ci_is_a_failure() {
        let err = std::panic::catch_unwind(|| skip_as(true, "probe", "why"))
            .expect_err("a skip under CI must panic");
        let text = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(text.contains("probe: cannot run here: why"), "{text}");
        assert!(text.contains("a skipped test is a failure"), "{text}");
    }

    #[test]
    fn a_skip_outside_ci_returns() {
        assert!(std::panic::catch_unwind(|| skip_as(false, "probe", "why")).is_ok());
    }
}
