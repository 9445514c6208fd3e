//! The author's stimulus command (`--inject 'CMD {text}'`): makes the platform deliver one
//! message. Run with `/bin/sh -c`, `{text}` replaced by the shell-quoted text.

use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

/// `template` with each `{text}` replaced by `text` in single quotes.
pub fn render(template: &str, text: &str) -> String {
    template.replace("{text}", &shell_quote(text))
}

/// `text` as one shell word.
pub fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// Runs the stimulus for `text`; the error says why it did not succeed.
pub async fn run(template: &str, text: &str, limit: Duration) -> Result<(), String> {
    let command = render(template, text);
    let child = Command::new("/bin/sh")
        .arg("-c")
        .arg(&command)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|err| format!("cannot run the --inject command: {err}"))?;
    match tokio::time::timeout(limit, child.wait_with_output()).await {
        Err(_) => Err(format!("the --inject command did not finish within {limit:?}")),
        Ok(Err(err)) => Err(format!("the --inject command failed: {err}")),
        Ok(Ok(output)) if output.status.success() => Ok(()),
        Ok(Ok(output)) => {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let last = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
            Err(format!("the --inject command failed ({}): {last}", output.status))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_is_one_shell_word() {
        assert_eq!(render("pub -m {text} -q 1", "hi there"), "pub -m 'hi there' -q 1");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }

    #[tokio::test]
    async fn a_failing_stimulus_says_so() {
        assert_eq!(run("test {text} = 'a b'", "a b", Duration::from_secs(5)).await, Ok(()));
        let err = run("echo nope >&2; false {text}", "x", Duration::from_secs(5)).await;
        assert!(err.unwrap_err().ends_with("nope"));
    }
}
