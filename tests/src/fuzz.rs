//! Mutation strategies for the drivers' fuzz tests: start from a recorded platform payload
//! (a fixture, shaped like what the platform sends) and change a few of its values, delete
//! keys, swap types, or cut the serialized text short. Structure-aware: most cases still
//! parse, so they reach the conversion rules instead of stopping at the JSON parser.

use proptest::prelude::*;
use serde_json::{Map, Value};

/// Hostile scalars and small structures a platform (or an attacker posing as one) may send
/// where a recorded payload had something else.
pub fn hostile_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => "\\PC{0,24}".prop_map(Value::from),
        1 => "[\\x00-\\x1f\"\\\\<>@:/#]{0,12}".prop_map(Value::from),
        1 => "\\PC{2000,4000}".prop_map(Value::from),
        1 => Just(Value::from("")),
        1 => any::<i64>().prop_map(Value::from),
        1 => any::<u64>().prop_map(Value::from),
        1 => any::<f64>().prop_map(|f| serde_json::json!(f)),
        1 => any::<bool>().prop_map(Value::from),
        1 => Just(Value::Null),
        1 => Just(serde_json::json!([])),
        1 => Just(serde_json::json!({})),
        1 => prop::collection::vec("\\PC{0,8}".prop_map(Value::from), 0..4).prop_map(Value::from),
    ]
}

/// One change to a JSON document, applied at the node chosen by `at` (an index into every
/// node, wrapped around).
#[derive(Debug, Clone)]
pub enum Mutation {
    Replace {
        at: usize,
        with: Value,
    },
    Remove {
        at: usize,
    },
    /// Adds a key (to an object node) with a hostile value.
    Insert {
        at: usize,
        key: String,
        with: Value,
    },
    /// Puts the node inside an array (`x` → `[x]`), a common type confusion.
    Wrap {
        at: usize,
    },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), hostile_value()).prop_map(|(at, with)| Mutation::Replace { at, with }),
        2 => any::<usize>().prop_map(|at| Mutation::Remove { at }),
        1 => (any::<usize>(), "[a-z_]{1,10}", hostile_value())
            .prop_map(|(at, key, with)| Mutation::Insert { at, key, with }),
        1 => any::<usize>().prop_map(|at| Mutation::Wrap { at }),
    ]
}

/// `seed` with one to five mutations applied.
pub fn mutated(seed: Value) -> impl Strategy<Value = Value> {
    prop::collection::vec(mutation(), 1..6).prop_map(move |mutations| {
        let mut value = seed.clone();
        for mutation in &mutations {
            apply(&mut value, mutation);
        }
        value
    })
}

/// One of `seeds`, mutated.
pub fn mutated_any(seeds: Vec<Value>) -> impl Strategy<Value = Value> {
    assert!(!seeds.is_empty(), "no seed payloads");
    (0..seeds.len()).prop_flat_map(move |index| mutated(seeds[index].clone()))
}

/// The bytes of a mutated seed, sometimes cut short or with a stray byte: for layers that
/// parse raw text themselves.
pub fn mutated_bytes(seeds: Vec<Value>) -> impl Strategy<Value = Vec<u8>> {
    (mutated_any(seeds), any::<prop::sample::Index>(), 0u8..4, any::<u8>()).prop_map(
        |(value, cut, how, byte)| {
            let mut bytes = serde_json::to_vec(&value).expect("a Value serializes");
            match how {
                0 => bytes.truncate(cut.index(bytes.len() + 1)),
                1 => {
                    let at = cut.index(bytes.len() + 1);
                    bytes.insert(at, byte);
                }
                _ => {}
            }
            bytes
        },
    )
}

/// Parses the recorded payloads: the fixtures are JSON text.
pub fn seeds(texts: &[&str]) -> Vec<Value> {
    texts.iter().map(|text| serde_json::from_str(text).expect("a JSON fixture")).collect()
}

fn apply(root: &mut Value, mutation: &Mutation) {
    let count = count_nodes(root);
    let (at, op) = match mutation {
        Mutation::Replace { at, .. }
        | Mutation::Remove { at }
        | Mutation::Insert { at, .. }
        | Mutation::Wrap { at } => (at % count, mutation),
    };
    let mut index = at;
    visit(root, &mut index, op);
}

fn count_nodes(value: &Value) -> usize {
    1 + match value {
        Value::Array(items) => items.iter().map(count_nodes).sum(),
        Value::Object(map) => map.values().map(count_nodes).sum(),
        _ => 0,
    }
}

/// Walks the nodes in order, counting `index` down; applies `op` at the node it reaches 0 on.
/// Returns true once applied.
fn visit(value: &mut Value, index: &mut usize, op: &Mutation) -> bool {
    if *index == 0 {
        match op {
            Mutation::Replace { with, .. } => *value = with.clone(),
            Mutation::Remove { .. } => *value = Value::Null,
            Mutation::Insert { key, with, .. } => match value {
                Value::Object(map) => {
                    map.insert(key.clone(), with.clone());
                }
                other => *other = with.clone(),
            },
            Mutation::Wrap { .. } => *value = Value::Array(vec![value.take()]),
        }
        return true;
    }
    *index -= 1;
    match value {
        Value::Array(items) => items.iter_mut().any(|item| visit(item, index, op)),
        Value::Object(map) => visit_object(map, index, op),
        _ => false,
    }
}

fn visit_object(map: &mut Map<String, Value>, index: &mut usize, op: &Mutation) -> bool {
    let keys: Vec<String> = map.keys().cloned().collect();
    for key in keys {
        if *index == 0 && matches!(op, Mutation::Remove { .. }) {
            map.remove(&key);
            return true;
        }
        let Some(child) = map.get_mut(&key) else { continue };
        if visit(child, index, op) {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    #[test]
    fn a_mutation_changes_the_seed_and_keeps_it_json() {
        let seed = serde_json::json!({"a": 1, "b": {"c": "text", "d": [1, 2]}});
        let mut runner = TestRunner::default();
        let mut changed = 0;
        for _ in 0..200 {
            let value = mutated(seed.clone()).new_tree(&mut runner).unwrap().current();
            serde_json::to_vec(&value).unwrap();
            if value != seed {
                changed += 1;
            }
        }
        // A replacement can pick the value that was there; nearly all cases differ.
        assert!(changed > 150, "{changed} of 200 changed");
    }
}
