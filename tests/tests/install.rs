//! `scripts/install` into a temp `DESTDIR`, with the binaries this test run built: binaries,
//! units pointing at them, the sysusers entry and the `/etc/channeld` skeleton with the right
//! modes; a second install keeps every file an operator may have edited; the installed
//! example configuration passes `channeld check`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use channeld_tests::bin_dir;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("repository root").to_path_buf()
}

fn install(destdir: &Path, extra: &[&str]) -> Output {
    let output = Command::new(repo().join("scripts/install"))
        .arg("--bin-dir")
        .arg(bin_dir())
        .arg("--destdir")
        .arg(destdir)
        .args(extra)
        .env_remove("DESTDIR")
        .env_remove("PREFIX")
        .env_remove("UNITDIR")
        .env_remove("SYSUSERSDIR")
        .env_remove("SYSCONFDIR")
        .stdin(Stdio::null())
        .output()
        .expect("run scripts/install");
    assert!(
        output.status.success(),
        "scripts/install failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|err| panic!("{}: {err}", path.display()))
        .permissions()
        .mode()
        & 0o7777
}

#[test]
fn install_lays_out_binaries_units_sysusers_and_the_config_skeleton() {
    let dest = tempfile::tempdir().expect("temp dir");
    let root = dest.path();
    install(root, &[]);

    let families =
        ["console", "mqtt", "amqp", "slack", "wechat", "wecom", "nostr", "acecode", "bcn"];
    let drivers = families.iter().map(|family| format!("channeld-{family}"));
    let tools = ["channeld-conformance".to_owned()].into_iter();
    let built = drivers.chain(tools).filter(|binary| bin_dir().join(binary).is_file());
    let binaries: Vec<String> =
        ["channeld".to_owned(), "channelctl".to_owned()].into_iter().chain(built).collect();
    assert!(binaries.iter().any(|b| b == "channeld-mqtt"), "channeld-mqtt was not built");
    for binary in &binaries {
        assert_eq!(mode(&root.join("usr/local/bin").join(binary)), 0o755, "{binary}");
    }
    let mut in_bin: Vec<String> = std::fs::read_dir(root.join("usr/local/bin"))
        .expect("bin dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    in_bin.sort();
    let mut expected_bin = binaries.clone();
    expected_bin.sort();
    assert_eq!(
        in_bin, expected_bin,
        "only channeld, channelctl, the conformance kit and drivers are installed"
    );
    let units = root.join("usr/local/lib/systemd/system");
    let mut installed: Vec<String> = std::fs::read_dir(&units)
        .expect("unit dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    installed.sort();
    // Units for the families that were built; the console needs a terminal and has none.
    let mut expected: Vec<String> =
        ["acecode", "amqp", "bcn", "mqtt", "nostr", "slack", "wechat", "wecom"]
            .iter()
            .filter(|family| bin_dir().join(format!("channeld-{family}")).is_file())
            .map(|family| format!("channeld-{family}@.service"))
            .collect();
    expected.push("channeld.service".into());
    assert_eq!(installed, expected);
    assert!(installed.contains(&"channeld-mqtt@.service".to_owned()), "{installed:?}");
    for unit in &installed {
        let body = std::fs::read_to_string(units.join(unit)).expect("read unit");
        let original = std::fs::read_to_string(repo().join("systemd").join(unit)).expect("unit");
        assert_eq!(body, original, "{unit} changed though the prefix is /usr/local");
        let exec = body.lines().find_map(|l| l.strip_prefix("ExecStart=")).expect("ExecStart");
        let binary = exec.split_whitespace().next().expect("binary");
        assert!(root.join(binary.trim_start_matches('/')).is_file(), "{unit} starts {binary}");
        assert_eq!(mode(&units.join(unit)), 0o644);
    }
    let sysusers = root.join("usr/local/lib/sysusers.d/channeld.conf");
    assert_eq!(
        std::fs::read_to_string(&sysusers).expect("sysusers entry"),
        std::fs::read_to_string(repo().join("systemd/channeld.sysusers")).expect("source")
    );

    let etc = root.join("etc/channeld");
    assert_eq!(mode(&etc.join("credentials")), 0o700);
    assert_eq!(mode(&etc.join("channeld.toml")), 0o640);
    assert!(etc.join("mqtt.env.example").is_file());
    assert!(etc.join("amqp.env.example").is_file());
    assert!(etc.join("slack.env.example").is_file());
    assert!(etc.join("wechat.env.example").is_file());
    assert!(etc.join("acecode.env.example").is_file());
    assert!(etc.join("bcn.env.example").is_file());
    assert_eq!(std::fs::read_dir(etc.join("credentials")).expect("credentials").count(), 0);

    let check = Command::new(root.join("usr/local/bin/channeld"))
        .arg("check")
        .arg("--config")
        .arg(etc.join("channeld.toml"))
        .output()
        .expect("run channeld check");
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
    assert!(String::from_utf8_lossy(&check.stdout).contains("2 instance(s)"));
}

#[test]
fn a_second_install_keeps_the_operators_files() {
    let dest = tempfile::tempdir().expect("temp dir");
    let root = dest.path();
    install(root, &[]);
    let config = root.join("etc/channeld/channeld.toml");
    let example = root.join("etc/channeld/mqtt.env.example");
    std::fs::write(&config, "# edited by the operator\n").expect("edit config");
    std::fs::write(&example, "# edited too\n").expect("edit example");
    let secret = root.join("etc/channeld/credentials/mqtt.lab.password");
    std::fs::write(&secret, "s3cret\n").expect("write credential");

    let output = install(root, &[]);
    assert_eq!(std::fs::read_to_string(&config).expect("config"), "# edited by the operator\n");
    assert_eq!(std::fs::read_to_string(&example).expect("example"), "# edited too\n");
    assert_eq!(std::fs::read_to_string(&secret).expect("credential"), "s3cret\n");
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(said.contains("kept existing /etc/channeld/channeld.toml"), "{said}");
}

#[test]
fn units_follow_the_prefix() {
    let dest = tempfile::tempdir().expect("temp dir");
    let root = dest.path();
    install(root, &["--prefix", "/opt/channeld"]);
    let unit = std::fs::read_to_string(
        root.join("opt/channeld/lib/systemd/system/channeld-mqtt@.service"),
    )
    .expect("mqtt unit under the prefix");
    assert!(unit.lines().any(|l| l == "ExecStart=/opt/channeld/bin/channeld-mqtt"), "{unit}");
    assert!(!unit.contains("/usr/local/"), "{unit}");
    let hub =
        std::fs::read_to_string(root.join("opt/channeld/lib/systemd/system/channeld.service"))
            .expect("hub unit");
    assert!(
        hub.contains("ExecStart=/opt/channeld/bin/channeld --config /etc/channeld/channeld.toml")
    );
    assert!(root.join("opt/channeld/bin/channeld").is_file());
}
