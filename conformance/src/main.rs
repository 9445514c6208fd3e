//! `channeld-conformance [--json] [--inject 'CMD {text}'] [--timeout SECS] -- COMMAND [ARGS…]`:
//! parses the flags, runs the checks on a single-threaded runtime and exits 0 (passed), 1 (a
//! check failed), 2 (usage) or 3 (could not run).

use std::io::Write;
use std::process::ExitCode;

use channeld_conformance::report::{self, EXIT_CANNOT_RUN, EXIT_USAGE};
use channeld_conformance::{Options, run};

fn main() -> ExitCode {
    let options = match Options::parse(std::env::args_os()) {
        Ok(options) => options,
        Err(err) if err.informational => {
            print!("{}", err.message);
            return ExitCode::SUCCESS;
        }
        Err(err) => {
            eprintln!("{}", err.message.trim_end());
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("channeld-conformance: cannot start the runtime: {err}");
            return ExitCode::from(EXIT_CANNOT_RUN);
        }
    };
    let json = options.json;
    let results = runtime.block_on(run(options, |result| {
        if !json {
            let mut stdout = std::io::stdout().lock();
            let _ = writeln!(stdout, "{}", result.line());
            let _ = stdout.flush();
        }
    }));
    match results {
        Ok(results) => {
            if json {
                println!("{}", report::to_json(&results));
            }
            eprintln!("channeld-conformance: {}", report::summary(&results));
            ExitCode::from(report::exit_status(&results))
        }
        Err(err) => {
            eprintln!("channeld-conformance: {err}");
            ExitCode::from(EXIT_CANNOT_RUN)
        }
    }
}
