//! Small codecs the API needs and the workspace has no crate for: percent
//! decoding of URLs, base64 (protobuf JSON carries bytes in it), RFC 3339
//! times, `multipart/form-data` bodies and random identifiers.

use std::time::{SystemTime, UNIX_EPOCH};

/// Percent-decode `s` (`+` is left as is: paths and SDK queries encode
/// spaces as `%20`).
pub fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
            if let Ok(v) = u8::from_str_radix(hex, 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The pairs of a query string (`a=1&b=2`), each part percent-decoded and
/// `+` read as a space.
pub fn parse_query(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (
                percent_decode(&k.replace('+', " ")),
                percent_decode(&v.replace('+', " ")),
            )
        })
        .collect()
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding.
pub fn base64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18u32, 12, 6, 0].iter().enumerate() {
            if i <= chunk.len() {
                out.push(B64[((n >> shift) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decode base64, standard or URL-safe, padded or not; `None` if it is not.
pub fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let mut acc = 0u32;
    let mut bits = 0;
    for c in text.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            b'=' => break,
            b'\r' | b'\n' | b' ' => continue,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Some(out)
}

/// Seconds since the epoch as RFC 3339 in UTC (`2024-05-01T12:00:00.123Z`).
pub fn rfc3339(secs: f64) -> String {
    let whole = secs.floor() as i64;
    let millis = ((secs - whole as f64) * 1000.0) as u32;
    let days = whole.div_euclid(86_400);
    let rem = whole.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Parse the RFC 3339 times the SDK sends (`…T…Z` or with an offset) into
/// seconds since the epoch.
pub fn parse_rfc3339(text: &str) -> Option<f64> {
    let (date, time) = text.split_once(['T', 't', ' '])?;
    let mut dp = date.split('-');
    let y: i64 = dp.next()?.parse().ok()?;
    let m: u32 = dp.next()?.parse().ok()?;
    let d: u32 = dp.next()?.parse().ok()?;
    let (clock, offset) = match time.find(['Z', 'z', '+', '-']) {
        Some(i) => (&time[..i], &time[i..]),
        None => (time, "Z"),
    };
    let mut tp = clock.split(':');
    let hh: f64 = tp.next()?.parse().ok()?;
    let mm: f64 = tp.next()?.parse().ok()?;
    let ss: f64 = tp.next().unwrap_or("0").parse().ok()?;
    let off = if offset.eq_ignore_ascii_case("z") {
        0.0
    } else {
        let sign = if offset.starts_with('-') { -1.0 } else { 1.0 };
        let (oh, om) = offset[1..].split_once(':').unwrap_or((&offset[1..], "0"));
        sign * (oh.parse::<f64>().ok()? * 3600.0 + om.parse::<f64>().ok()? * 60.0)
    };
    Some(days_from_civil(y, m, d) as f64 * 86_400.0 + hh * 3600.0 + mm * 60.0 + ss - off)
}

// Howard Hinnant's civil calendar algorithms.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Seconds since the epoch, now.
pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// `n` random bytes as lower-case hex.
pub fn random_hex(n: usize) -> String {
    let mut bytes = vec![0u8; n];
    if getrandom::getrandom(&mut bytes).is_err() {
        // The kernel's random source cannot fail on Linux ≥ 3.17 once
        // initialised; fall back to the clock rather than give up.
        let t = now().to_bits().to_le_bytes();
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = t[i % 8] ^ (i as u8);
        }
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One part of a `multipart/form-data` body.
#[derive(Debug)]
pub struct Part {
    /// The form field's name.
    pub name: String,
    /// The file name, if the part is a file.
    pub filename: Option<String>,
    /// The content.
    pub data: Vec<u8>,
}

/// The parts of a `multipart/form-data` body whose `Content-Type` is
/// `content_type`; `None` if it is not such a body.
pub fn multipart(content_type: &str, body: &[u8]) -> Option<Vec<Part>> {
    let boundary = content_type.split(';').find_map(|p| {
        let p = p.trim();
        p.strip_prefix("boundary=")
            .map(|b| b.trim_matches('"').to_string())
    })?;
    let delim = format!("--{boundary}").into_bytes();
    let mut parts = Vec::new();
    let mut pos = find(body, &delim, 0)? + delim.len();
    loop {
        // After a delimiter: "--" ends the body, else CRLF and a part.
        if body[pos..].starts_with(b"--") {
            return Some(parts);
        }
        pos = find(body, b"\r\n", pos)? + 2;
        let head_end = find(body, b"\r\n\r\n", pos)?;
        let head = String::from_utf8_lossy(&body[pos..head_end]).into_owned();
        let data_start = head_end + 4;
        let mut next_delim = b"\r\n".to_vec();
        next_delim.extend_from_slice(&delim);
        let data_end = find(body, &next_delim, data_start)?;
        let mut name = String::new();
        let mut filename = None;
        for line in head.split("\r\n") {
            let Some((k, v)) = line.split_once(':') else {
                continue;
            };
            if !k.trim().eq_ignore_ascii_case("content-disposition") {
                continue;
            }
            for param in v.split(';').skip(1) {
                let Some((pk, pv)) = param.trim().split_once('=') else {
                    continue;
                };
                let pv = pv.trim().trim_matches('"').to_string();
                match pk.trim() {
                    "name" => name = pv,
                    "filename" => filename = Some(pv),
                    "filename*" => {
                        let encoded = pv.split("''").last().unwrap_or(&pv);
                        filename = Some(percent_decode(encoded));
                    }
                    _ => {}
                }
            }
        }
        parts.push(Part {
            name,
            filename,
            data: body[data_start..data_end].to_vec(),
        });
        pos = data_end + next_delim.len();
    }
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if from > hay.len() || needle.is_empty() {
        return None;
    }
    hay[from..]
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|i| i + from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips() {
        for s in ["", "a", "ab", "abc", "abcd", "hello world\n\0\u{ff}"] {
            let e = base64_encode(s.as_bytes());
            assert_eq!(base64_decode(&e).unwrap(), s.as_bytes(), "{e}");
        }
        assert_eq!(base64_encode(b"hi"), "aGk=");
        assert_eq!(base64_decode("YWJj").unwrap(), b"abc");
        assert!(base64_decode("a*b").is_none());
    }

    #[test]
    fn times_round_trip() {
        assert_eq!(rfc3339(0.0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_700_000_000.5), "2023-11-14T22:13:20.500Z");
        let t = parse_rfc3339("2023-11-14T22:13:20.5Z").unwrap();
        assert!((t - 1_700_000_000.5).abs() < 1e-6);
        let t = parse_rfc3339("2023-11-14T23:13:20+01:00").unwrap();
        assert!((t - 1_700_000_000.0).abs() < 1e-6);
    }

    #[test]
    fn queries_and_paths_decode() {
        assert_eq!(percent_decode("/a%20b/%2Fc%"), "/a b//c%");
        assert_eq!(
            parse_query("path=%2Fhome%2Fx&username=user&e="),
            vec![
                ("path".into(), "/home/x".into()),
                ("username".into(), "user".into()),
                ("e".into(), String::new())
            ]
        );
    }

    #[test]
    fn multipart_bodies_split_into_parts() {
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a/b.txt\"\r\nContent-Type: application/octet-stream\r\n\r\nline1\r\nline2\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"c\"\r\n\r\n\r\n--XyZ--\r\n";
        let parts = multipart("multipart/form-data; boundary=XyZ", body).unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].filename.as_deref(), Some("a/b.txt"));
        assert_eq!(parts[0].data, b"line1\r\nline2");
        assert_eq!(parts[1].data, b"");
        assert!(multipart("application/json", body).is_none());
    }
}
