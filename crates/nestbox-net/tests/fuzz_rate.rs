//! Fuzzing the bandwidth parser (`--net-rate`, `--net-reserve`,
//! `--net-ingress-rate`, network pool rates) and the port mapping parser
//! (`-p`): no input may panic; a rate accepted is at least one byte per second
//! and reads back from its own display as the same rate; every error is one
//! line.
//!
//! Budget: see `bench/fuzz/budget.rs` (`NESTBOX_FUZZ_SECS`).

#[path = "../../../bench/fuzz/budget.rs"]
mod budget;

use nestbox_net::{parse_rate, PortMapping, Rate};
use proptest::prelude::*;

fn rate_text() -> impl Strategy<Value = String> {
    let unit = prop_oneof![
        Just(""),
        Just("bit"),
        Just("kbit"),
        Just("Mbit"),
        Just("gbit"),
        Just("TBIT"),
        Just("kibit"),
        Just("mibit"),
        Just("gibit"),
        Just("tibit"),
        Just("bps"),
        Just("kbps"),
        Just("mbps"),
        Just("gbps"),
        Just("tbps"),
        Just("ibit"),
        Just("b"),
    ];
    let number = prop_oneof![
        any::<u64>().prop_map(|n| n.to_string()),
        (0u64..100_000).prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| f.to_string()),
        "[0-9]{0,25}\\.?[0-9]{0,25}",
        "[0-9.eE+-]{0,12}",
    ];
    prop_oneof![
        4 => (" ?", number, unit, " ?").prop_map(|(a, n, u, b)| format!("{a}{n}{u}{b}")),
        1 => any::<String>(),
        1 => "\\PC{0,12}",
    ]
}

#[test]
fn rate_parser() {
    budget::fuzz("rate_parser", 5000, rate_text(), |text| {
        match parse_rate(&text) {
            Ok(r) => {
                prop_assert!(r.bits() >= 8);
                prop_assert_eq!(parse_rate(&r.to_string()).ok(), Some(r));
                prop_assert_eq!(Rate::from_bits(r.bits()), Some(r));
                // Serialised (as in a stored spec) it reads back the same.
                let json = serde_json::to_string(&r).unwrap();
                prop_assert_eq!(serde_json::from_str::<Rate>(&json).ok(), Some(r));
            }
            Err(e) => {
                let t = e.to_string();
                prop_assert!(!t.is_empty() && !t.contains('\n'), "{t:?}");
            }
        }
        // A stored spec's rate is parsed the same way.
        let stored = serde_json::from_str::<Rate>(&serde_json::to_string(&text).unwrap());
        prop_assert_eq!(stored.ok(), parse_rate(&text).ok());
        Ok(())
    });
}

#[test]
fn port_parser() {
    let text = prop_oneof![
        "[0-9]{0,7}:[0-9]{0,7}(/tcp|/udp|/TCP|/)?",
        "[0-9:/a-z+-]{0,16}",
        any::<String>(),
    ];
    budget::fuzz("port_parser", 5000, text, |text| {
        match PortMapping::parse(&text) {
            Ok(p) => {
                prop_assert!(p.host_port > 0 && p.box_port > 0);
                let ports = text.split('/').next().unwrap();
                let (h, b) = ports.split_once(':').unwrap();
                prop_assert_eq!(
                    (h.parse::<u16>(), b.parse::<u16>()),
                    (Ok(p.host_port), Ok(p.box_port))
                );
            }
            Err(e) => {
                let t = e.to_string();
                prop_assert!(!t.is_empty() && !t.contains('\n'), "{t:?}");
            }
        }
        Ok(())
    });
}
