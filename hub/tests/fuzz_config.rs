//! Property fuzzing of `channeld.toml` loading: any mutation of a valid configuration is either
//! a valid configuration or a `ConfigError` with a message, never a panic.

use channeld_hub::{HubConfig, Overrides};
use proptest::prelude::*;
use std::path::Path;

/// The installed example configuration, with an exec runtime and a second instance enabled so
/// more of the schema is reached.
const BASE: &str = include_str!("fixtures/channeld.toml");

fn base() -> String {
    format!(
        "{BASE}\n[runtime.agent]\nkind = \"exec\"\ncommand = [\"/bin/cat\"]\ntimeout_secs = 5\n\n\
         [instance.\"console.one\"]\nruntime = \"agent\"\nallow_all = true\n"
    )
}

/// One edit: replace a span by a fragment that matters to TOML or to our schema.
fn edit() -> impl Strategy<Value = (prop::sample::Index, usize, String)> {
    let fragment = prop_oneof![
        Just(String::new()),
        Just("\"".to_owned()),
        Just("[".to_owned()),
        Just("]".to_owned()),
        Just("=".to_owned()),
        Just("\n".to_owned()),
        Just("-1".to_owned()),
        Just("18446744073709551616".to_owned()),
        Just("0".to_owned()),
        Just("true".to_owned()),
        Just("[instance.\"x\"]\n".to_owned()),
        Just("[runtime.r]\nkind = \"amqp\"\n".to_owned()),
        "\\PC{0,12}",
    ];
    (any::<prop::sample::Index>(), 0usize..24, fragment)
}

fn apply(text: &str, edits: &[(prop::sample::Index, usize, String)]) -> String {
    let mut bytes = text.as_bytes().to_vec();
    for (at, len, with) in edits {
        let start = at.index(bytes.len().max(1)).min(bytes.len());
        let end = (start + len).min(bytes.len());
        bytes.splice(start..end, with.bytes());
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

#[test]
fn the_base_configuration_is_valid() {
    HubConfig::parse(&base(), Path::new("channeld.toml"), &Overrides::default()).unwrap();
}

proptest! {
    #[test]
    fn fuzz_any_edit_of_a_valid_config_loads_or_is_refused(
        edits in prop::collection::vec(edit(), 1..5)
    ) {
        let text = apply(&base(), &edits);
        let overrides = Overrides::default();
        if let Err(err) = HubConfig::parse(&text, Path::new("channeld.toml"), &overrides) {
            prop_assert!(!err.to_string().is_empty());
        }
    }
}
