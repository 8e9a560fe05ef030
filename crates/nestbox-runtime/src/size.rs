//! Human sizes (`64m`, `1.5g`, `512k`, `1024`) as used by `--memory`, and back.

use crate::{Result, RuntimeError};

/// Parse a size in bytes: a number with an optional unit b, k, m, g, t (powers of
/// 1024, case-insensitive, an optional trailing `b`/`ib` accepted: `64MiB`).
pub fn parse_size(text: &str) -> Result<u64> {
    let bad = || {
        RuntimeError::InvalidInput(format!(
            "invalid size {text:?} (expected e.g. 64m, 1.5g, 512k or a byte count)"
        ))
    };
    let t = text.trim().to_ascii_lowercase();
    let t = t.strip_suffix("ib").map(|s| s.to_string()).unwrap_or(t);
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(bad());
    }
    let mult: u64 = match unit {
        "" | "b" => 1,
        "k" | "kb" => 1 << 10,
        "m" | "mb" => 1 << 20,
        "g" | "gb" => 1 << 30,
        "t" | "tb" => 1 << 40,
        _ => return Err(bad()),
    };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or_else(bad);
    }
    let f: f64 = num.parse().map_err(|_| bad())?;
    let bytes = f * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes.round() as u64)
}

/// Format bytes for people: `64 MiB`, `1.5 GiB`, `512 B`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 || v.fract() == 0.0 {
        format!("{} {}", v as u64, UNITS[i])
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_size("64m").unwrap(), 64 << 20);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("1.5g").unwrap(), 3 << 29);
        assert_eq!(parse_size("512k").unwrap(), 512 << 10);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("10b").unwrap(), 10);
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["", "m", "12x", "-1m", "1.2.3g", "99999999999999999999t"] {
            let e = parse_size(bad).unwrap_err().to_string();
            assert!(e.contains("invalid size"), "{bad}: {e}");
        }
    }

    #[test]
    fn formats() {
        assert_eq!(format_size(64 << 20), "64 MiB");
        assert_eq!(format_size(3 << 29), "1.5 GiB");
        assert_eq!(format_size(100), "100 B");
    }
}
