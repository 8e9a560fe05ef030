//! The budget of a fuzz property, shared by the `fuzz_*` test files (each
//! includes this file with `#[path]`): by default a fixed number of cases, small
//! enough for CI; with `NESTBOX_FUZZ_SECS=N` as many cases as fit in N seconds
//! of wall time. Cases come from proptest strategies; a panic in the code under
//! test is caught by proptest, shrunk to a small input and reported as a failure.
//! Each property prints one line `fuzz-stats target=… seconds=… cases=…
//! failures=…` that `bench/fuzz.sh` collects.

use std::fmt::Debug;
use std::time::{Duration, Instant};

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, TestCaseResult, TestRunner};

/// Cases generated per round when running on a time budget.
const ROUND: u32 = 32;

/// The wall time each property runs for, if `NESTBOX_FUZZ_SECS` asks for one.
pub fn budget() -> Option<Duration> {
    let text = std::env::var("NESTBOX_FUZZ_SECS").ok()?;
    let secs: f64 = text
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("NESTBOX_FUZZ_SECS={text:?} is not a number of seconds"));
    (secs > 0.0).then(|| Duration::from_secs_f64(secs))
}

/// Check `test` on inputs drawn from `strategy`: `default_cases` of them, or
/// as many as fit in the time budget. Panics (failing the test) with the
/// shrunk input on the first failure.
pub fn fuzz<S>(
    target: &str,
    default_cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> TestCaseResult,
) where
    S: Strategy,
    S::Value: Debug,
{
    let budget = budget();
    let per_round = if budget.is_some() {
        ROUND
    } else {
        default_cases
    };
    let config = Config {
        cases: per_round,
        failure_persistence: None,
        // Shrinking a failure found late in a long run must not take as long again.
        max_shrink_time: 120_000,
        ..Config::default()
    };
    let start = Instant::now();
    let mut cases: u64 = 0;
    loop {
        // A runner counts its successes for good, so each round has its own
        // (seeded from the OS: every round and every run draws new cases).
        let mut runner = TestRunner::new(config.clone());
        if let Err(e) = runner.run(&strategy, &test) {
            println!(
                "fuzz-stats target={target} seconds={:.1} cases={cases} failures=1",
                start.elapsed().as_secs_f64()
            );
            panic!("{target}: {e}");
        }
        cases += u64::from(per_round);
        match budget {
            Some(b) if start.elapsed() < b => {}
            _ => break,
        }
    }
    println!(
        "fuzz-stats target={target} seconds={:.1} cases={cases} failures=0",
        start.elapsed().as_secs_f64()
    );
}
