//! `channeld-console`: a channeld driver for the terminal. Each line typed on stdin is an
//! inbound message; replies are printed on stdout, logs go to stderr.

use std::io::{ErrorKind, IsTerminal, Read};
use std::process::ExitCode;

use channeld_console::{ConsoleConfig, ConsoleDriver};
use channeld_driver_sdk::DriverError;
use tokio::io::{AsyncWriteExt, DuplexStream};

/// Allocates with mimalloc, as the hub does: glibc's malloc took a fifth of an SDK driver's
/// time per message (BENCHMARKS.md, twenty-fourth round).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Bytes of stdin buffered between the reading thread and the driver.
const STDIN_BUFFER: usize = 64 * 1024;

fn main() -> ExitCode {
    channeld_driver_sdk::main(|launch| async move {
        let user = std::env::var("USER").ok();
        let config = ConsoleConfig::from_launch(&launch, user.as_deref())?;
        let input = spawn_stdin_reader()
            .map_err(|err| DriverError::Platform(format!("cannot read stdin: {err}")))?;
        let interactive = std::io::stdout().is_terminal();
        Ok(ConsoleDriver::new(config, input, tokio::io::stdout(), interactive))
    })
}

/// Reads stdin on a dedicated thread and hands the bytes over through an in-memory pipe.
///
/// tokio's own stdin reads on its blocking pool, and a read that never returns (an idle
/// terminal or pipe) keeps the runtime from shutting down after SIGTERM. A detached thread
/// ends with the process instead.
fn spawn_stdin_reader() -> std::io::Result<DuplexStream> {
    let runtime = tokio::runtime::Handle::current();
    let (input, mut pipe) = tokio::io::duplex(STDIN_BUFFER);
    std::thread::Builder::new().name("stdin".into()).spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut chunk = vec![0u8; 8 * 1024];
        loop {
            let read = match stdin.read(&mut chunk) {
                Ok(0) => break,
                Ok(read) => read,
                Err(err) if err.kind() == ErrorKind::Interrupted => continue,
                Err(err) => {
                    tracing::warn!(error = %err, "cannot read stdin, treating it as ended");
                    break;
                }
            };
            // Fails only once the driver stopped reading.
            if runtime.block_on(pipe.write_all(&chunk[..read])).is_err() {
                break;
            }
        }
        // Dropping the pipe is the driver's end of input.
    })?;
    Ok(input)
}
