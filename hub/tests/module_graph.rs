//! Architecture invariants of the hub crate, read from its source: the modules' `crate::`
//! edges form a DAG (no import circle), the ledger imports nothing from the rest of the hub,
//! and the pure decisions (the inbound decision, the ledger's SQL functions and state
//! machines, the run queue and route bookkeeping) use no async runtime.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, as paths relative to `src/`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path.strip_prefix(src()).expect("under src").to_path_buf());
        }
    }
}

/// The top-level module a file belongs to (`inbound/run.rs` → `inbound`).
fn module_of(file: &Path) -> String {
    let first = file.components().next().expect("a component").as_os_str().to_string_lossy();
    first.trim_end_matches(".rs").to_owned()
}

/// The top-level modules `text` names through `crate::` paths, grouped ones included
/// (`crate::{a, b::c}`).
fn crate_references(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        let names: Vec<&str> = match rest.strip_prefix('{') {
            Some(group) => group.split('}').next().unwrap_or("").split(',').collect(),
            None => vec![rest],
        };
        for name in names {
            let ident: String = name
                .trim_start()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !ident.is_empty() {
                found.insert(ident);
            }
        }
    }
    found
}

/// Module → the modules it uses, for every file of the library (not the binaries).
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    sources(&src(), &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        if file.starts_with("bin") || file == Path::new("lib.rs") {
            continue;
        }
        let module = module_of(&file);
        let text = std::fs::read_to_string(src().join(&file)).expect("read source");
        let uses: Vec<String> =
            crate_references(&text).into_iter().filter(|used| *used != module).collect();
        graph.entry(module).or_default().extend(uses);
    }
    graph
}

/// A topological order of `graph`, or the modules left on a cycle.
fn topological_order(
    graph: &BTreeMap<String, BTreeSet<String>>,
) -> Result<Vec<String>, BTreeSet<String>> {
    let mut left: BTreeMap<&String, BTreeSet<&String>> = graph
        .iter()
        .map(|(module, uses)| (module, uses.iter().filter(|u| graph.contains_key(*u)).collect()))
        .collect();
    let mut order = Vec::new();
    while !left.is_empty() {
        let ready: Vec<&String> =
            left.iter().filter(|(_, uses)| uses.is_empty()).map(|(m, _)| *m).collect();
        if ready.is_empty() {
            return Err(left.keys().map(|m| (*m).clone()).collect());
        }
        for module in ready {
            left.remove(module);
            order.push(module.clone());
            for uses in left.values_mut() {
                uses.remove(module);
            }
        }
    }
    Ok(order)
}

#[test]
fn the_modules_of_the_hub_form_a_dag() {
    let graph = graph();
    for (module, uses) in &graph {
        eprintln!("{module} -> {}", uses.iter().cloned().collect::<Vec<_>>().join(", "));
    }
    match topological_order(&graph) {
        Ok(order) => eprintln!("bottom-up: {}", order.join(", ")),
        Err(cycle) => panic!("import circle among: {cycle:?}"),
    }
    for expected in [
        "inbound",
        "ledger",
        "serve",
        "control",
        "outbox",
        "courier",
        "hub",
        "lifecycle",
        "metrics",
        "scrape",
        "agent",
        "locator",
        "history",
        "clock",
        "proactive",
        "sendq",
    ] {
        assert!(
            graph.contains_key(expected),
            "module {expected} not found: the check read nothing"
        );
    }
}

#[test]
fn the_ledger_imports_nothing_from_the_hub() {
    let graph = graph();
    let uses = graph.get("ledger").cloned().unwrap_or_default();
    assert!(uses.is_empty(), "ledger uses {uses:?}");
}

#[test]
fn locators_are_decoded_by_a_module_that_uses_nothing_else_of_the_hub() {
    // Only the hub decodes locators, in one place that needs nothing but the protocol types.
    let graph = graph();
    let uses = graph.get("locator").cloned().unwrap_or_default();
    assert!(uses.is_empty(), "locator uses {uses:?}");
}

#[test]
fn the_clock_uses_nothing_from_the_hub() {
    // Everything that stamps ledger times reads it, so it sits at the bottom.
    let graph = graph();
    let uses = graph.get("clock").cloned().unwrap_or_default();
    assert!(uses.is_empty(), "clock uses {uses:?}");
}

#[test]
fn metrics_sit_below_everything_that_counts() {
    // Every module may count, so the metrics module uses nothing but the ledger's own
    // histograms; what reads the hub's state for a scrape lives in `scrape`.
    let graph = graph();
    let uses = graph.get("metrics").cloned().unwrap_or_default();
    assert_eq!(uses, BTreeSet::from(["ledger".to_owned()]), "metrics uses {uses:?}");
}

#[test]
fn history_sits_between_the_ledger_and_its_callers() {
    // Drivers (serve) and the control socket read history through `history`, which reads
    // the ledger; nothing below it (the ledger, the inbound path) uses it.
    let graph = graph();
    let uses = graph.get("history").cloned().unwrap_or_default();
    for below in ["serve", "control", "inbound", "courier"] {
        assert!(!uses.contains(below), "history uses {below}");
    }
    for caller in ["serve", "control"] {
        assert!(graph[caller].contains("history"), "{caller} does not use history");
    }
    assert!(!graph["ledger"].contains("history"));
}

#[test]
fn pure_decisions_use_no_async_runtime_and_no_sockets() {
    let pure = [
        "inbound/decide.rs",
        "inbound/fingerprint.rs",
        "ledger/inbound.rs",
        "ledger/outbox.rs",
        "ledger/replies.rs",
        "ledger/reply_state.rs",
        "ledger/sessions.rs",
        "ledger/state.rs",
        "ledger/schema.rs",
        "ledger/items.rs",
        "locator.rs",
        "ledger/history.rs",
        "ledger/ops.rs",
        "clock.rs",
        "runqueue.rs",
        "route.rs",
        "command.rs",
        "metrics/process.rs",
        "operator.rs",
    ];
    for file in pure {
        let text = std::fs::read_to_string(src().join(file)).expect(file);
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        // `command.rs` presents commands asynchronously; only its vetting must be pure.
        if file == "command.rs" {
            let vet = code.split("pub fn vet_answer").nth(1).expect("vet_answer");
            assert!(!vet.contains(".await"), "vet_answer awaits");
            continue;
        }
        // `operator.rs` sends and waits; only its gate must be pure.
        if file == "operator.rs" {
            let gate = code.split("pub fn gate").nth(1).expect("gate");
            let gate = gate.split("pub async fn").next().unwrap_or_default();
            assert!(!gate.contains(".await"), "gate awaits");
            continue;
        }
        for forbidden in ["tokio", "async fn", ".await", "UnixStream", "std::net"] {
            assert!(!code.contains(forbidden), "{file} uses {forbidden}");
        }
    }
}

#[test]
fn the_reference_parser_sees_grouped_and_nested_paths() {
    let text = "use crate::a::B;\nuse crate::{c, d::E};\nlet x = crate::f::g();";
    let found: Vec<String> = crate_references(text).into_iter().collect();
    assert_eq!(found, ["a", "c", "d", "f"]);
    let mut graph = BTreeMap::new();
    graph.insert("a".to_owned(), BTreeSet::from(["b".to_owned()]));
    graph.insert("b".to_owned(), BTreeSet::from(["a".to_owned()]));
    assert!(topological_order(&graph).is_err(), "a cycle must be found");
}

/// The control op `send` and the AMQP send queue answer through one implementation
/// (`proactive`), and only the lifecycle starts the send queue's consumer.
#[test]
fn both_send_paths_go_through_proactive() {
    let graph = graph();
    for caller in ["control", "sendq"] {
        assert!(graph[caller].contains("proactive"), "{caller} does not use proactive");
    }
    let users: Vec<&String> =
        graph.iter().filter(|(_, uses)| uses.contains("sendq")).map(|(m, _)| m).collect();
    assert_eq!(users, ["lifecycle"], "sendq is used by {users:?}");
}
