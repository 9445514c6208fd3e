//! Unit tests of the ACECode plugin protocol types: manifest rules one at a time, line
//! parsing, text splitting.

use super::*;

fn dir() -> PathBuf {
    PathBuf::from("/opt/connectors/example")
}

fn valid() -> Value {
    serde_json::json!({
        "schema": "acecode.channel-platform.v1",
        "name": "example",
        "label": "Example IM",
        "command": "example-im",
        "args": ["--channel-transport", "--cwd", "${manifest_dir}"],
        "account": "self",
        "features": ["watched_groups", "something_newer"]
    })
}

fn check(manifest: &Value) -> Result<Manifest, ManifestError> {
    Manifest::validate(&manifest.to_string(), &dir(), |p| {
        p == Path::new("/opt/connectors/example/example-im") || p == Path::new("/usr/bin/im")
    })
}

fn with(key: &str, value: Value) -> Value {
    let mut m = valid();
    m[key] = value;
    m
}

fn without(key: &str) -> Value {
    let mut m = valid();
    m.as_object_mut().unwrap().remove(key);
    m
}

#[test]
fn the_seed_example_is_valid_with_its_dir_substituted_and_unknown_features_ignored() {
    let m = check(&valid()).unwrap();
    assert_eq!(m.name, "example");
    assert_eq!(m.command, Path::new("/opt/connectors/example/example-im"));
    assert_eq!(m.args, ["--channel-transport", "--cwd", "/opt/connectors/example"]);
    assert!(m.watched_groups);
    let m = check(&without("features")).unwrap();
    assert!(!m.watched_groups);
    let abs = check(&with("command", "/usr/bin/im".into())).unwrap();
    assert_eq!(abs.command, Path::new("/usr/bin/im"));
}

#[test]
fn each_rule_is_rejected_by_itself_and_named() {
    let cases: Vec<(Value, &str)> = vec![
        (with("schema", "acecode.channel-platform.v2".into()), "schema must be"),
        (without("schema"), "schema must be"),
        (with("name", "Example".into()), "name must match"),
        (with("name", "e".into()), "name must match"),
        (with("name", "a".repeat(33).into()), "name must match"),
        (with("name", "ex_ample".into()), "name must match"),
        (with("label", "".into()), "label must be 1-64 bytes"),
        (with("label", "é".repeat(33).into()), "label must be 1-64 bytes"),
        (without("command"), "command must be a non-empty string"),
        (with("command", "missing-im".into()), "is not an existing regular file"),
        (with("args", serde_json::json!(vec!["a"; 33])), "args must be an array of at most 32"),
        (with("args", serde_json::json!([1])), "args must be an array"),
        (with("args", "--x".into()), "args must be an array"),
        (with("account", "bot".into()), "account must be \"self\""),
        (without("account"), "account must be \"self\""),
        (with("features", "watched_groups".into()), "features must be an array"),
        (with("features", serde_json::json!([true])), "features must be an array"),
    ];
    for (manifest, rule) in cases {
        let err = check(&manifest).expect_err(&manifest.to_string()).to_string();
        assert!(err.contains(rule), "{manifest}: {err} does not name {rule:?}");
    }
    assert!(check(&with("args", serde_json::json!(vec!["a"; 32]))).is_ok());
    assert!(check(&with("label", "x".repeat(64).into())).is_ok());
    let not_object = Manifest::validate("[1]", &dir(), |_| true).unwrap_err();
    assert!(matches!(not_object, ManifestError::NotAnObject(_)));
}

#[test]
fn plugin_lines_are_responses_events_or_ignored_and_non_objects_are_errors() {
    let r = parse_plugin_line(br#"{"id":3,"ok":true,"result":{"outcome":"sent"}}"#).unwrap();
    assert_eq!(r, PluginLine::Response(Response::ok(3, serde_json::json!({"outcome":"sent"}))));
    let e = parse_plugin_line(br#"{"event":"status","params":{"state":"connected"}}"#).unwrap();
    assert!(matches!(e, PluginLine::Event(ev) if ev.event == "status"));
    assert_eq!(parse_plugin_line(br#"{"hello":1}"#).unwrap(), PluginLine::Other);
    assert!(matches!(parse_plugin_line(b"[1,2]"), Err(LineError::NotAnObject(_))));
    assert!(matches!(parse_plugin_line(b"not json"), Err(LineError::NotAnObject(_))));
    let req = parse_host_line(br#"{"id":1,"method":"send_text","params":{}}"#).unwrap();
    assert!(matches!(req, HostLine::Request(r) if r.method == "send_text"));
    let note = parse_host_line(br#"{"method":"set_typing","params":{}}"#).unwrap();
    assert!(matches!(note, HostLine::Notification(_)));
}

#[test]
fn text_is_split_by_characters_or_utf16_units_never_inside_a_character() {
    assert_eq!(split_text("hello", 10, false), ["hello"]);
    assert_eq!(split_text("", 10, false), [""]);
    let emoji = "😀".repeat(5);
    // Five characters, ten UTF-16 units.
    assert_eq!(split_text(&emoji, 5, false).len(), 1);
    let pieces = split_text(&emoji, 4, true);
    assert_eq!(pieces, ["😀😀", "😀😀", "😀"]);
    let words = "aaaa bbbb cccc dddd";
    let pieces = split_text(words, 10, false);
    assert_eq!(pieces, ["aaaa bbbb ", "cccc dddd"]);
    assert_eq!(pieces.concat(), words);
    for piece in split_text(&"é".repeat(100), 7, true) {
        assert!(piece.encode_utf16().count() <= 7);
    }
}

#[test]
fn capabilities_clamp_text_units_and_default_to_4000() {
    let caps: PluginCapabilities = serde_json::from_str("{}").unwrap();
    assert_eq!(caps.text_units(), 4000);
    let tiny = PluginCapabilities { max_text_units: Some(3), ..caps.clone() };
    assert_eq!(tiny.text_units(), 64);
    let huge = PluginCapabilities { max_text_units: Some(1 << 20), ..caps };
    assert_eq!(huge.text_units(), 65536);
    assert_eq!(method_timeout("send_text"), Duration::from_secs(60));
    assert_eq!(method_timeout("send_file"), Duration::from_secs(120));
    assert_eq!(method_timeout("shutdown"), Duration::from_secs(3));
}
