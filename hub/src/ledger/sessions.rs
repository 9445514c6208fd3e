//! Conversation sessions in the ledger: the generation of each route, bumped by `/new`, so a
//! new session survives a hub restart. Synchronous functions over one transaction.

use std::collections::HashMap;

use rusqlite::{Connection, params};

use super::LedgerError;
use super::store::Cached;

/// Starts a new session generation for a route; returns it.
pub fn bump_generation(txn: &Connection, instance: &str, route: &str) -> Result<u64, LedgerError> {
    txn.exec_cached(
        "INSERT INTO sessions (instance, route, generation) VALUES (?1, ?2, 1)
         ON CONFLICT (instance, route) DO UPDATE SET generation = generation + 1",
        params![instance, route],
    )?;
    let generation: i64 = txn.query_row_cached(
        "SELECT generation FROM sessions WHERE instance = ?1 AND route = ?2",
        params![instance, route],
        |row| row.get(0),
    )?;
    Ok(generation as u64)
}

/// Every session generation of `instance`, by route.
pub fn generations(txn: &Connection, instance: &str) -> Result<HashMap<String, u64>, LedgerError> {
    let mut stmt = txn.prepare("SELECT route, generation FROM sessions WHERE instance = ?1")?;
    let rows = stmt.query_map(params![instance], |row| {
        Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)? as u64))
    })?;
    Ok(rows.collect::<Result<HashMap<_, _>, _>>()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::schema;

    #[test]
    fn generations_count_up_per_route_and_instance() {
        let mut db = schema::open_in_memory().unwrap();
        let txn = db.transaction().unwrap();
        assert_eq!(bump_generation(&txn, "a.b", "im-1").unwrap(), 1);
        assert_eq!(bump_generation(&txn, "a.b", "im-1").unwrap(), 2);
        assert_eq!(bump_generation(&txn, "a.b", "im-2").unwrap(), 1);
        assert_eq!(bump_generation(&txn, "a.c", "im-1").unwrap(), 1);
        let loaded = generations(&txn, "a.b").unwrap();
        assert_eq!(loaded.len(), 2);
        assert_eq!(loaded["im-1"], 2);
        assert_eq!(loaded["im-2"], 1);
    }
}
