//! Configuration parsing: defaults, overrides, errors that name the key, peer lists.
use super::*;

fn parse(text: &str) -> Result<HubConfig, ConfigError> {
    HubConfig::parse(text, Path::new("test.toml"), &Overrides::default())
}

#[test]
fn minimal_config_has_defaults() {
    let config = parse("[instance.\"console.demo\"]\nallow_all = true\n").unwrap();
    assert_eq!(config.runtime_dir, PathBuf::from("/run/channeld"));
    assert_eq!(config.control_socket, PathBuf::from("/run/channeld/control.sock"));
    let instance = &config.instances[0];
    assert_eq!(instance.socket, PathBuf::from("/run/channeld/console.demo.sock"));
    assert_eq!(instance.max_inflight, 4);
    assert_eq!(instance.max_queued, 64);
    assert_eq!(instance.allow, Allowlist::All);
    assert_eq!(config.runtime_for(instance).kind, RuntimeKind::Echo);
    assert_eq!(config.cpu_scheduling, CpuScheduling::Batch);
}

#[test]
fn cpu_scheduling_is_batch_or_inherit() {
    let config = parse("[hub]\ncpu_scheduling = \"inherit\"\n").unwrap();
    assert_eq!(config.cpu_scheduling, CpuScheduling::Inherit);
    let config = parse("[hub]\ncpu_scheduling = \"batch\"\n").unwrap();
    assert_eq!(config.cpu_scheduling, CpuScheduling::Batch);
    let err = parse("[hub]\ncpu_scheduling = \"fifo\"\n").unwrap_err().to_string();
    assert!(err.contains("cpu_scheduling") && err.contains("fifo"), "{err}");
}

#[test]
fn max_queued_is_set_for_the_hub_and_per_instance() {
    let text =
        "[hub]\nmax_queued = 8\n[instance.\"a.one\"]\n[instance.\"a.two\"]\nmax_queued = 0\n";
    let config = parse(text).unwrap();
    assert_eq!(config.instances[0].max_queued, 8);
    assert_eq!(config.instances[1].max_queued, 0);
}

#[test]
fn runtime_dir_flag_overrides_the_file() {
    let overrides = Overrides { runtime_dir: Some("/tmp/x".into()), state_dir: None };
    let text = "[hub]\nruntime_dir = \"/run/y\"\n[instance.\"mqtt.lab\"]\n";
    let config = HubConfig::parse(text, Path::new("t"), &overrides).unwrap();
    assert_eq!(config.instances[0].socket, PathBuf::from("/tmp/x/mqtt.lab.sock"));
    assert!(config.instances[0].allow.denies_everyone());
}

#[test]
fn unknown_keys_are_errors_that_name_the_key() {
    let err = parse("[instance.\"a.b\"]\nalow = [\"x\"]\n").unwrap_err().to_string();
    assert!(err.contains("alow"), "{err}");
    let err = parse("[hub]\nmax_inflight = 0\n").unwrap_err().to_string();
    assert_eq!(err, "hub.max_inflight: must be at least 1");
    let err = parse("[instance.\"Bad Name\"]\n").unwrap_err().to_string();
    assert!(err.starts_with("instance.\"Bad Name\""), "{err}");
    let err = parse("[instance.\"a.b\"]\nruntime = \"nope\"\n").unwrap_err().to_string();
    assert!(err.starts_with("instance.\"a.b\".runtime"), "{err}");
    let err = parse("[runtime.agent]\nkind = \"exec\"\n").unwrap_err().to_string();
    assert_eq!(err, "runtime.agent.command: an exec runtime needs a command");
}

#[test]
fn two_instances_cannot_share_a_socket() {
    let text = "[instance.\"a.x\"]\nsocket = \"/tmp/s\"\n[instance.\"a.y\"]\nsocket = \"/tmp/s\"\n";
    let err = parse(text).unwrap_err().to_string();
    assert!(err.contains("already used"), "{err}");
}

#[test]
fn peer_lists_take_numbers_and_names_and_default_to_the_socket_mode() {
    let config = parse("[instance.\"a.b\"]\n").unwrap();
    assert_eq!(config.instances[0].peers, PeerRule::SocketMode);
    let text = "[instance.\"a.b\"]\nallow_uids = [12345, \"root\"]\nallow_gids = [\"root\"]\n";
    let config = parse(text).unwrap();
    assert_eq!(config.instances[0].peers, PeerRule::Listed { uids: vec![12345, 0], gids: vec![0] });
    let err =
        parse("[instance.\"a.b\"]\nallow_gids = [\"no-such-group-x\"]\n").unwrap_err().to_string();
    assert_eq!(err, "instance.\"a.b\".allow_gids: no group named \"no-such-group-x\"");
    let err = parse("[instance.\"a.b\"]\nallow_uids = []\n").unwrap_err().to_string();
    assert!(err.starts_with("instance.\"a.b\".allow_uids: empty lists"), "{err}");
    let err = parse("[instance.\"a.b\"]\nallow_uids = [-1]\n").unwrap_err().to_string();
    assert!(err.contains("allow_uids"), "{err}");
}

#[test]
fn the_control_socket_defaults_to_the_socket_mode_and_takes_its_own_lists() {
    let config = parse("[instance.\"a.b\"]\n").unwrap();
    assert_eq!(config.control_peers, PeerRule::SocketMode);
    let config =
        parse("[hub]\ncontrol_allow_uids = [4242]\ncontrol_allow_gids = [\"root\"]\n").unwrap();
    assert_eq!(config.control_peers, PeerRule::Listed { uids: vec![4242], gids: vec![0] });
    let err = parse("[hub]\ncontrol_allow_gids = [\"no-such-group-x\"]\n").unwrap_err().to_string();
    assert_eq!(err, "hub.control_allow_gids: no group named \"no-such-group-x\"");
    let err = parse("[hub]\ncontrol_allow_uids = []\n").unwrap_err().to_string();
    assert!(err.starts_with("hub.control_allow_uids: empty lists"), "{err}");
}

#[test]
fn allowlist_semantics() {
    assert!(!Allowlist::Senders(vec![]).permits("u1"));
    assert!(Allowlist::Senders(vec!["u1".into()]).permits("u1"));
    assert!(!Allowlist::Senders(vec!["u1".into()]).permits("u2"));
    assert!(Allowlist::All.permits("anyone"));
}

#[test]
fn allowlist_entries_with_stray_or_invisible_characters_are_warned_about() {
    let text = "[instance.\"a.b\"]\nallow = [\"alice\", \" bob\", \"carol\\u200b\", \"d\\u00a0e\", \"zoë\", \"two words\"]\n\
                [instance.\"a.c\"]\n";
    let warnings = parse(text).unwrap().warnings();
    assert_eq!(
        warnings,
        vec![
            "instance.\"a.b\".allow: \" bob\" has leading or trailing whitespace".to_owned(),
            "instance.\"a.b\".allow: \"carol\\u{200b}\" contains an invisible character (U+200B)"
                .to_owned(),
            "instance.\"a.b\".allow: \"d\\u{a0}e\" contains an invisible character (U+00A0)"
                .to_owned(),
            "instance.\"a.c\".allow: sender allowlist is empty: every inbound message will be denied (set allow = [...] or allow_all = true)".to_owned(),
        ]
    );
    assert!(parse("[instance.\"a.b\"]\nallow_all = true\n").unwrap().warnings().is_empty());
}

#[test]
fn deny_notices_are_rate_limited_and_must_be_a_body() {
    let config = parse("[instance.\"a.b\"]\ndeny_notice = \"private\"\n").unwrap();
    assert_eq!(config.instances[0].deny_notice_interval, Duration::from_secs(3600));
    let text = "[instance.\"a.b\"]\ndeny_notice = \"private\"\ndeny_notice_interval_secs = 60\n";
    assert_eq!(parse(text).unwrap().instances[0].deny_notice_interval, Duration::from_secs(60));
    let err = parse("[instance.\"a.b\"]\ndeny_notice = \" \"\n").unwrap_err().to_string();
    assert_eq!(err, "instance.\"a.b\".deny_notice: must not be empty");
    let text = format!("[instance.\"a.b\"]\ndeny_notice = \"{}\"\n", "x".repeat(20_000));
    assert!(parse(&text).unwrap_err().to_string().contains("at most 16384 bytes"));
    let err = parse("[instance.\"a.b\"]\ndeny_notice_interval_secs = 0\n").unwrap_err().to_string();
    assert_eq!(err, "instance.\"a.b\".deny_notice_interval_secs: must be at least 1");
}

#[test]
fn metrics_listen_is_off_by_default_and_takes_an_address_or_a_socket_path() {
    assert_eq!(parse("").unwrap().metrics_listen, None);
    let tcp = parse("[hub]\nmetrics_listen = \"127.0.0.1:9464\"\n").unwrap();
    assert_eq!(tcp.metrics_listen, Some(MetricsListen::Tcp("127.0.0.1:9464".parse().unwrap())));
    let unix = parse("[hub]\nmetrics_listen = \"/run/channeld/metrics.sock\"\n").unwrap();
    assert_eq!(
        unix.metrics_listen,
        Some(MetricsListen::Unix(PathBuf::from("/run/channeld/metrics.sock")))
    );
    let err = parse("[hub]\nmetrics_listen = \"localhost\"\n").unwrap_err().to_string();
    assert!(err.starts_with("hub.metrics_listen:"), "{err}");
}

#[test]
fn an_amqp_runtime_takes_its_url_from_a_credential_never_from_the_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("runs-url"), "amqp://u:secret@broker:5672/%2f\n").unwrap();
    // SAFETY: only this test reads CREDENTIALS_DIRECTORY in the config tests.
    unsafe { std::env::set_var("CREDENTIALS_DIRECTORY", dir.path()) };
    let base = "[runtime.r]\nkind = \"amqp\"\nqueue = \"runs\"\nreply_queue = \"replies\"\n";
    let config = parse(&format!("{base}url = \"credential:runs-url\"\n")).unwrap();
    let target = config.runtimes["r"].amqp.clone().unwrap();
    assert_eq!(target.url.expose(), "amqp://u:secret@broker:5672/%2f");
    assert!(!format!("{config:?}").contains("secret"), "the URL never prints");

    let err = parse(&format!("{base}url = \"amqp://u:secret@broker\"\n")).unwrap_err();
    let text = err.to_string();
    assert!(text.starts_with("runtime.r.url:") && !text.contains("u:secret"), "{text}");
    let err = parse(&format!("{base}url = \"credential:missing\"\n")).unwrap_err();
    assert!(err.to_string().starts_with("runtime.r.url:"), "{err}");
    let err =
        parse("[runtime.r]\nkind = \"amqp\"\nurl = \"credential:runs-url\"\nreply_queue = \"x\"\n")
            .unwrap_err();
    assert!(err.to_string().starts_with("runtime.r.queue:"), "{err}");
    let err =
        parse("[runtime.r]\nkind = \"exec\"\ncommand = [\"a\"]\nqueue = \"q\"\n").unwrap_err();
    assert!(err.to_string().starts_with("runtime.r.queue:"), "{err}");
}

#[test]
fn an_amqp_runtime_url_may_list_a_clusters_nodes() {
    let base = "[runtime.r]\nkind = \"amqp\"\nqueue = \"runs\"\nreply_queue = \"replies\"\n";
    let list = "amqp://u:secret@n1:5672/%2f, amqp://u:secret@n2:5672/%2f";
    // SAFETY: only this test reads these variables.
    unsafe { std::env::set_var("CHANNELD_CONFIG_TEST_CLUSTER_URL", list) };
    let config = parse(&format!("{base}url = \"env:CHANNELD_CONFIG_TEST_CLUSTER_URL\"\n")).unwrap();
    assert_eq!(config.runtimes["r"].amqp.clone().unwrap().url.expose(), list);
    unsafe { std::env::set_var("CHANNELD_CONFIG_TEST_BAD_LIST", "amqp://n1/%2f,http://n2/") };
    let err = parse(&format!("{base}url = \"env:CHANNELD_CONFIG_TEST_BAD_LIST\"\n")).unwrap_err();
    assert!(err.to_string().starts_with("runtime.r.url:"), "{err}");
    unsafe { std::env::set_var("CHANNELD_CONFIG_TEST_EMPTY_LIST", " , ") };
    let err = parse(&format!("{base}url = \"env:CHANNELD_CONFIG_TEST_EMPTY_LIST\"\n")).unwrap_err();
    assert!(err.to_string().starts_with("runtime.r.url:"), "{err}");
}

#[test]
fn a_body_free_runtime_with_max_runs_serializes_its_instances() {
    let text = "[runtime.resident]\nkind = \"exec\"\ncommand = [\"/bin/agent\"]\n\
                wake = \"body_free\"\nmax_runs = 1\n\
                [instance.\"a.one\"]\nruntime = \"resident\"\nmax_inflight = 8\n\
                [instance.\"a.two\"]\n";
    let config = parse(text).unwrap();
    let one = &config.instances[0];
    assert_eq!(config.runtime_for(one).wake, Wake::BodyFree);
    assert_eq!(one.max_inflight, 1, "max_runs lowers max_inflight");
    assert_eq!(config.instances[1].max_inflight, 4);
    assert_eq!(config.runtime_for(&config.instances[1]).wake, Wake::Full);
    let err = parse("[runtime.r]\nkind = \"exec\"\ncommand = [\"a\"]\nmax_runs = 0\n").unwrap_err();
    assert!(err.to_string().contains("runtime.r.max_runs"), "{err}");
    let err = parse("[runtime.r]\nkind = \"exec\"\ncommand = [\"a\"]\nwake = \"bodyless\"\n")
        .unwrap_err();
    assert!(err.to_string().contains("wake") || err.to_string().contains("bodyless"), "{err}");
}

#[test]
fn the_send_queue_takes_its_url_from_the_environment_and_needs_the_ledger() {
    // SAFETY: only this test reads CONFIG_TEST_SENDS_URL.
    unsafe { std::env::set_var("CONFIG_TEST_SENDS_URL", "amqp://app:pw-77@broker/%2f") };
    let with_ledger = "[hub]\nstate_dir = \"/var/lib/channeld\"\n[hub.amqp_sends]\n";
    let config = parse(&format!("{with_ledger}url = \"env:CONFIG_TEST_SENDS_URL\"\n")).unwrap();
    let sends = config.amqp_sends.clone().unwrap();
    assert_eq!(sends.url.expose(), "amqp://app:pw-77@broker/%2f");
    assert_eq!((sends.queue.as_str(), sends.prefetch), ("channeld.sends", 16));
    assert!(!format!("{config:?}").contains("pw-77"), "the URL never prints");
    assert!(parse("").unwrap().amqp_sends.is_none());

    let err = parse(&format!("{with_ledger}url = \"amqp://app:pw-77@broker\"\n")).unwrap_err();
    let text = err.to_string();
    assert!(text.starts_with("hub.amqp_sends.url:") && !text.contains("pw-77"), "{text}");
    let err = parse("[hub.amqp_sends]\nurl = \"env:CONFIG_TEST_SENDS_URL\"\n").unwrap_err();
    assert!(err.to_string().contains("hub.state_dir"), "{err}");
    let zero = format!("{with_ledger}url = \"env:CONFIG_TEST_SENDS_URL\"\nprefetch = 0\n");
    assert!(parse(&zero).unwrap_err().to_string().starts_with("hub.amqp_sends.prefetch:"));
    let bad_queue =
        format!("{with_ledger}url = \"env:CONFIG_TEST_SENDS_URL\"\nqueue = \"amq.x\"\n");
    assert!(parse(&bad_queue).unwrap_err().to_string().starts_with("hub.amqp_sends.queue:"));
}
