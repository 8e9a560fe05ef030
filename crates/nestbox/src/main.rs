//! `nestbox`: the command-line front end. It parses options into a box spec or an
//! operation, calls the runtime, and turns any error into one line on stderr with
//! Docker's exit codes (125 nestbox error, 126 cannot execute, 127 not found,
//! otherwise the command's own status).

mod cli;
mod network_cmd;
mod output;
mod service_cmd;
mod snapshot_cmd;
mod store_cmd;

use std::process::ExitCode;

use clap::error::ErrorKind;

fn main() -> ExitCode {
    // A box's monitor or init renewing its image goes on from here.
    nestbox_runtime::lifecycle::lean::entry();
    nestbox_runtime::phases::init();
    let args = match cli::Cli::parse_args() {
        Ok(args) => {
            nestbox_runtime::phases::mark("cli: arguments parsed");
            args
        }
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            e.exit()
        }
        Err(e) => {
            // One line, like every other error, with Docker's exit code for bad usage.
            let text = e.to_string();
            let first = text
                .lines()
                .next()
                .unwrap_or_default()
                .trim_start_matches("error: ");
            eprintln!("nestbox: error: {first}");
            return ExitCode::from(nestbox_runtime::error::EXIT_NESTBOX_ERROR as u8);
        }
    };
    // Warnings of the CLI's own process go to stderr; a detached monitor and
    // `nestbox serve` switch to their log files.
    nestbox_runtime::diag::to_stderr();
    match cli::dispatch(args) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            let code = e
                .downcast_ref::<nestbox_runtime::RuntimeError>()
                .map(|r| r.exit_code())
                .unwrap_or(nestbox_runtime::error::EXIT_NESTBOX_ERROR);
            eprintln!("nestbox: error: {}", one_line(&e));
            ExitCode::from(code as u8)
        }
    }
}

/// The error on one line: the CLI's own contexts (`--memory: …`), then the first
/// typed error, whose message already carries its causes (every nestbox error
/// type shows its cause in its message), so its sources are not printed again.
fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        parts.push(cause.to_string());
        if is_complete(cause) {
            break;
        }
    }
    parts.join(": ").replace('\n', " ")
}

/// Whether an error's message is the whole story: a nestbox error type, or one
/// without a source. Only the CLI's contexts (anyhow's) fail this.
fn is_complete(e: &(dyn std::error::Error + 'static)) -> bool {
    e.source().is_none()
        || e.is::<nestbox_runtime::RuntimeError>()
        || e.is::<nestbox_net::NetError>()
        || e.is::<nestbox_store::StoreError>()
        || e.is::<nestbox_image::ImageError>()
        || e.is::<nestbox_cgroup::CgroupError>()
        || e.is::<std::io::Error>()
}
