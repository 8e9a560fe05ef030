//! Bandwidth rates as `tc` writes them: `100mbit`, `1.5gbit`, `10mbps` (bytes),
//! `512kibit`. A bare number is bits per second, as in `tc`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{NetError, Result};

/// A rate in bits per second (at least 8, i.e. one byte per second).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Rate(u64);

/// Units accepted after the number, with their multiplier in bits per second.
const UNITS: &[(&str, f64)] = &[
    ("", 1.0),
    ("bit", 1.0),
    ("kbit", 1e3),
    ("mbit", 1e6),
    ("gbit", 1e9),
    ("tbit", 1e12),
    ("kibit", 1024.0),
    ("mibit", 1024.0 * 1024.0),
    ("gibit", 1024.0 * 1024.0 * 1024.0),
    ("tibit", 1024.0 * 1024.0 * 1024.0 * 1024.0),
    ("bps", 8.0),
    ("kbps", 8e3),
    ("mbps", 8e6),
    ("gbps", 8e9),
    ("tbps", 8e12),
];

impl Rate {
    /// The smallest rate (one byte per second).
    pub const MIN: Rate = Rate(8);

    /// A rate of `bits` bits per second; `None` below one byte per second.
    pub fn from_bits(bits: u64) -> Option<Rate> {
        (bits >= 8).then_some(Rate(bits))
    }

    /// Bits per second.
    pub fn bits(self) -> u64 {
        self.0
    }

    /// Bytes per second.
    pub fn bytes(self) -> u64 {
        self.0 / 8
    }
}

/// Parse a rate such as `10mbit`; see the module documentation.
pub fn parse_rate(text: &str) -> Result<Rate> {
    let bad = || NetError::InvalidRate(text.to_string());
    let t = text.trim().to_ascii_lowercase();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(bad());
    }
    let value: f64 = num.parse().map_err(|_| bad())?;
    let mult = UNITS
        .iter()
        .find(|(u, _)| *u == unit)
        .map(|(_, m)| *m)
        .ok_or_else(bad)?;
    let bits = value * mult;
    if !bits.is_finite() || bits < 8.0 || bits > u64::MAX as f64 {
        return Err(bad());
    }
    Ok(Rate(bits.round() as u64))
}

impl FromStr for Rate {
    type Err = NetError;
    fn from_str(s: &str) -> Result<Rate> {
        parse_rate(s)
    }
}

impl fmt::Display for Rate {
    /// The largest decimal unit that divides the rate exactly (`10mbit`), else bits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (unit, div) in [("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)] {
            let div = div as u64;
            if self.0 % div == 0 {
                return write!(f, "{}{unit}", self.0 / div);
            }
        }
        write!(f, "{}bit", self.0)
    }
}

impl TryFrom<String> for Rate {
    type Error = NetError;
    fn try_from(s: String) -> Result<Rate> {
        parse_rate(&s)
    }
}

impl From<Rate> for String {
    fn from(r: Rate) -> String {
        r.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tc_units() {
        assert_eq!(parse_rate("10mbit").unwrap().bits(), 10_000_000);
        assert_eq!(parse_rate("1.5Gbit").unwrap().bits(), 1_500_000_000);
        assert_eq!(parse_rate("10mbps").unwrap().bits(), 80_000_000);
        assert_eq!(parse_rate("1kibit").unwrap().bits(), 1024);
        assert_eq!(parse_rate("8000").unwrap().bits(), 8000);
        assert_eq!(parse_rate(" 100kbit ").unwrap().bytes(), 12_500);
    }

    #[test]
    fn rejects_nonsense() {
        for bad in [
            "",
            "mbit",
            "10 parsecs",
            "-5mbit",
            "0",
            "1bit",
            "1e3mbit",
            "1..2mbit",
            "nan",
        ] {
            let err = parse_rate(bad).unwrap_err();
            assert!(matches!(err, NetError::InvalidRate(_)), "{bad}: {err}");
            assert!(!err.to_string().contains('\n'));
        }
    }

    #[test]
    fn displays_round_trip() {
        for s in ["10mbit", "1gbit", "1500kbit", "12345bit"] {
            assert_eq!(parse_rate(s).unwrap().to_string(), s);
        }
        let r = parse_rate("2mbps").unwrap();
        assert_eq!(parse_rate(&r.to_string()).unwrap(), r);
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(json, "\"16mbit\"");
        assert_eq!(serde_json::from_str::<Rate>(&json).unwrap(), r);
    }
}
