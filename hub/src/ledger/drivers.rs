//! What the ledger remembers of each instance's driver across a restart: the names (never the
//! values) of the environment it gives its runs (extension `agent_env`), so the runs a restart
//! recovers wait for that environment instead of starting without it. Kept in `meta` under
//! `agent_env:<instance>`, the names joined by commas (a name is `A-Z`, `0-9` and `_`).
//! Synchronous functions over one transaction.

use std::collections::HashMap;

use rusqlite::{Connection, params};

use super::LedgerError;
use super::store::Cached;

/// The `meta` keys this module owns start with this.
const PREFIX: &str = "agent_env:";

/// Records the names of `instance`'s agent environment; none forgets it.
pub fn set_agent_env_names(
    txn: &Connection,
    instance: &str,
    names: &[String],
) -> Result<(), LedgerError> {
    let key = format!("{PREFIX}{instance}");
    if names.is_empty() {
        txn.exec_cached("DELETE FROM meta WHERE key = ?1", params![key])?;
    } else {
        txn.exec_cached(
            "INSERT INTO meta (key, value) VALUES (?1, ?2)
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            params![key, names.join(",")],
        )?;
    }
    Ok(())
}

/// The names recorded for each instance whose driver gave its runs an environment.
pub fn agent_env_names(txn: &Connection) -> Result<HashMap<String, Vec<String>>, LedgerError> {
    // `PREFIX` with `:` bumped to `;`: the keys between are exactly those starting with it.
    let mut stmt = txn
        .prepare("SELECT key, value FROM meta WHERE key >= 'agent_env:' AND key < 'agent_env;'")?;
    let rows =
        stmt.query_map([], |row| Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?)))?;
    let mut names = HashMap::new();
    for row in rows {
        let (key, value) = row?;
        if let Some(instance) = key.strip_prefix(PREFIX) {
            names.insert(instance.to_owned(), value.split(',').map(str::to_owned).collect());
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::schema;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn names_are_kept_per_instance_replaced_and_forgotten_when_empty() {
        let mut db = schema::open_in_memory().unwrap();
        let txn = db.transaction().unwrap();
        assert!(agent_env_names(&txn).unwrap().is_empty());
        set_agent_env_names(&txn, "bcn.main", &names(&["BCN_BOT_TOKEN", "BCN_URL"])).unwrap();
        set_agent_env_names(&txn, "bcn.other", &names(&["BCN_BOT_TOKEN"])).unwrap();
        set_agent_env_names(&txn, "bcn.main", &names(&["BCN_BOT_TOKEN"])).unwrap();
        let loaded = agent_env_names(&txn).unwrap();
        assert_eq!(loaded.len(), 2);
        assert_eq!(loaded["bcn.main"], names(&["BCN_BOT_TOKEN"]));
        set_agent_env_names(&txn, "bcn.main", &[]).unwrap();
        let loaded = agent_env_names(&txn).unwrap();
        assert_eq!(loaded.keys().collect::<Vec<_>>(), vec!["bcn.other"]);
        // The ledger's own keys are not taken for an instance's.
        assert!(!loaded.contains_key("ledger_id"));
    }
}
