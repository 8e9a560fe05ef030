//! Time `open_image(NAME).root_view(None)` — what `nestbox run` does to get a box
//! root view — for an image whose tree is already cached, and print the median,
//! p90 and max in microseconds as one JSON line.
//!
//! Usage: `view_latency IMAGES_DIR NAME [RUNS]` (IMAGES_DIR is `$ROOT/lib/images`).

use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: view_latency IMAGES_DIR NAME [RUNS]");
        std::process::exit(2);
    }
    let dir = std::path::Path::new(&args[1]);
    let runs: usize = args.get(3).and_then(|r| r.parse().ok()).unwrap_or(1000);
    let mut us = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t = Instant::now();
        let view = nestbox_image::open_image(&args[2], dir)
            .and_then(|i| i.root_view(None))
            .unwrap_or_else(|e| {
                eprintln!("view_latency: {e}");
                std::process::exit(1);
            });
        us.push(t.elapsed().as_secs_f64() * 1e6);
        assert!(!view.layers.is_empty());
    }
    us.sort_by(f64::total_cmp);
    let pick = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize];
    println!(
        "{{\"runs\": {runs}, \"median_us\": {:.1}, \"p90_us\": {:.1}, \"max_us\": {:.1}}}",
        pick(0.5),
        pick(0.9),
        pick(1.0)
    );
}
