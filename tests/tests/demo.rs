//! `channeld demo`: the README's first command, through the real binaries.

use std::io::Write;
use std::process::{Command, Stdio};

use channeld_tests::workspace_bin;

fn demo(input: &str) -> std::process::Output {
    let runtime = tempfile::tempdir().unwrap();
    let mut child = Command::new(workspace_bin("channeld"))
        .arg("demo")
        .env("XDG_RUNTIME_DIR", runtime.path())
        .env_remove("CHANNELD_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn channeld demo");
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    let leftovers: Vec<_> = std::fs::read_dir(runtime.path()).unwrap().collect();
    assert!(leftovers.is_empty(), "the demo left its runtime directory behind: {leftovers:?}");
    output
}

#[test]
fn echo_hello_prints_the_reply_and_exits_zero() {
    let output = demo("hello\n");
    assert!(
        output.status.success(),
        "exit {:?}; stderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&output.stdout), "hello\n");
}

#[test]
fn several_lines_and_hub_commands_are_answered_in_order() {
    let output = demo("one\ntwo\n/new\nthree\n");
    assert!(output.status.success(), "stderr:\n{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{stdout}");
    for expected in ["one", "two", "Started a new session.", "three"] {
        assert!(lines.contains(&expected), "missing {expected:?} in {stdout}");
    }
}

#[test]
fn empty_input_exits_zero_without_output() {
    let output = demo("");
    assert!(output.status.success());
    assert!(output.stdout.is_empty());
}
