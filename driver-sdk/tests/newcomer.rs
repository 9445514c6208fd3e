//! The README's "Writing a driver" steps, as a newcomer runs them: its `src/main.rs` is the
//! compiled example, and a driver crate made from its own code blocks, outside the workspace
//! with the SDK by path, builds offline (sharing the workspace's target directory, so only
//! what differs is compiled).

use std::path::{Path, PathBuf};
use std::process::Command;

const README: &str = include_str!("../../README.md");
const EXAMPLE: &str = include_str!("../examples/file_drop.rs");

/// The fenced block that follows `<!-- newcomer: {file} -->` in the README.
fn readme_block(file: &str) -> String {
    let marker = format!("<!-- newcomer: {file} -->");
    let after = README.split_once(&marker).unwrap_or_else(|| panic!("README.md has no {marker}")).1;
    let fence = after.find("```").unwrap_or_else(|| panic!("no code block after {marker}"));
    let body = &after[fence..];
    let start = body.find('\n').expect("a fence line") + 1;
    let end =
        body[start..].find("\n```").unwrap_or_else(|| panic!("unclosed block after {marker}"));
    body[start..start + end + 1].to_owned()
}

/// The workspace's target directory: where this test binary was built.
fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test>-<hash>
    exe.ancestors().nth(3).expect("target directory").to_path_buf()
}

#[test]
fn the_readme_example_is_the_compiled_example() {
    assert_eq!(
        readme_block("src/main.rs"),
        EXAMPLE,
        "README.md's src/main.rs block differs from driver-sdk/examples/file_drop.rs: copy the example into the README"
    );
}

#[test]
fn a_driver_crate_outside_the_workspace_builds_from_the_readme_steps() {
    let sdk = Path::new(env!("CARGO_MANIFEST_DIR"));
    let workspace = sdk.parent().expect("the SDK lives in the workspace");
    let dir = tempfile::Builder::new().prefix("newcomer-").tempdir().expect("temp dir");
    // What `cargo new --bin file-drop` writes, then the README's dependencies.
    let manifest = format!(
        "[package]\nname = \"file-drop\"\nversion = \"0.1.0\"\nedition = \"2024\"\n\n{}\n[workspace]\n",
        readme_block("Cargo.toml").replace("../channeld/driver-sdk", &sdk.display().to_string())
    );
    std::fs::write(dir.path().join("Cargo.toml"), manifest).expect("write Cargo.toml");
    std::fs::create_dir(dir.path().join("src")).expect("src dir");
    std::fs::write(dir.path().join("src/main.rs"), readme_block("src/main.rs")).expect("main.rs");
    // The workspace's resolution, so the offline build picks the versions already built.
    std::fs::copy(workspace.join("Cargo.lock"), dir.path().join("Cargo.lock")).expect("lock");

    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    let mut command = Command::new(cargo);
    // Not the variables cargo set for this test (`CARGO_MANIFEST_DIR`, `CARGO_PKG_*`, …):
    // build scripts that watch them would rebuild what the workspace already built.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_") && name != "CARGO_HOME" {
            command.env_remove(name.as_ref());
        }
    }
    let output = command
        .current_dir(dir.path())
        .env("CARGO_TARGET_DIR", target_dir())
        .args(["build", "--offline", "--all-targets", "--quiet"])
        // The workspace's dev profile, so its compiled dependencies are reused.
        .args(["--config", "profile.dev.debug=\"line-tables-only\""])
        .args(["--config", "profile.dev.package.\"*\".opt-level=1"])
        .output()
        .expect("run cargo");
    assert!(
        output.status.success(),
        "the README's driver does not build outside the workspace:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
