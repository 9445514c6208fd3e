//! The ledger's database: opening it (WAL, durability), the schema migrations, and the
//! ledger's own id.

use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags, OptionalExtension, params};
use tracing::info;

/// Schema migrations, applied in order; `PRAGMA user_version` records how many ran.
const MIGRATIONS: &[&str] = &[
    // 1: inbound ledger, outbox, session generations, metadata.
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
     CREATE TABLE inbound (
         instance TEXT NOT NULL,
         event_id TEXT NOT NULL,
         content_hash BLOB NOT NULL,
         run_id TEXT NOT NULL,
         state TEXT NOT NULL,
         frame BLOB NOT NULL,
         attempts INTEGER NOT NULL,
         reply TEXT,
         error_code TEXT,
         error_message TEXT,
         received_ms INTEGER NOT NULL,
         updated_ms INTEGER NOT NULL,
         PRIMARY KEY (instance, event_id)
     ) WITHOUT ROWID;
     CREATE INDEX inbound_by_state ON inbound (state, instance);
     CREATE INDEX inbound_by_age ON inbound (updated_ms);
     CREATE TABLE outbox (
         id INTEGER PRIMARY KEY,
         instance TEXT NOT NULL,
         idempotency_key TEXT,
         message BLOB NOT NULL,
         state TEXT NOT NULL,
         receipt BLOB,
         error TEXT,
         attempts INTEGER NOT NULL DEFAULT 0,
         created_ms INTEGER NOT NULL,
         updated_ms INTEGER NOT NULL,
         expires_ms INTEGER NOT NULL
     );
     CREATE UNIQUE INDEX outbox_by_key ON outbox (instance, idempotency_key)
         WHERE idempotency_key IS NOT NULL;
     CREATE INDEX outbox_by_state ON outbox (state, instance, id);
     CREATE TABLE sessions (
         instance TEXT NOT NULL,
         route TEXT NOT NULL,
         generation INTEGER NOT NULL,
         PRIMARY KEY (instance, route)
     ) WITHOUT ROWID;",
    // 2: which version of the content fingerprint `content_hash` is. Entries written before
    // this migration hold version 1 (a hash over serde's encoding of the frame); they are
    // compared by recomputing the current version from their stored frame.
    "ALTER TABLE inbound ADD COLUMN hash_version INTEGER NOT NULL DEFAULT 1;",
    // 3: the delivery of each reply (`ledger/replies.rs`). Replies owed by a hub from before
    // (inbound `replied`, no row here) are recorded as pending when the hub starts.
    "CREATE TABLE replies (
         id INTEGER PRIMARY KEY,
         instance TEXT NOT NULL,
         event_id TEXT NOT NULL,
         conversation TEXT NOT NULL,
         message BLOB NOT NULL,
         state TEXT NOT NULL,
         attempts INTEGER NOT NULL DEFAULT 0,
         next_ms INTEGER NOT NULL,
         expires_ms INTEGER NOT NULL,
         receipt BLOB,
         error TEXT,
         created_ms INTEGER NOT NULL,
         updated_ms INTEGER NOT NULL
     );
     CREATE UNIQUE INDEX replies_by_event ON replies (instance, event_id);
     CREATE INDEX replies_by_state ON replies (state, instance, id);
     CREATE INDEX replies_by_conversation ON replies (instance, conversation, state, id);",
    // 4: conversation history (`ledger/history.rs`): admitted inbound texts and posted
    // replies per instance, conversation and thread (`''` when none).
    "CREATE TABLE history (
         id INTEGER PRIMARY KEY,
         instance TEXT NOT NULL,
         conversation TEXT NOT NULL,
         thread TEXT NOT NULL,
         role TEXT NOT NULL,
         text TEXT NOT NULL,
         sender TEXT,
         message_id TEXT,
         event_id TEXT,
         reply_id INTEGER,
         at_ms INTEGER NOT NULL
     );
     CREATE INDEX history_by_conversation ON history (instance, conversation, thread, id);
     CREATE INDEX history_by_event ON history (instance, event_id);
     CREATE INDEX history_by_age ON history (at_ms);",
    // 5 (issue 16): the agent's inbox (`ledger/items.rs`): one item per admitted inbound,
    // its structural ids, the reply `respond` sent and whether it was handled. Inbound
    // recorded before this migration has no item.
    "CREATE TABLE items (
         id INTEGER PRIMARY KEY,
         instance TEXT NOT NULL,
         event_id TEXT NOT NULL,
         conversation TEXT NOT NULL,
         thread TEXT,
         message_id TEXT,
         sender TEXT,
         received_ms INTEGER NOT NULL,
         outbox_id INTEGER,
         handled_ms INTEGER,
         handled_by TEXT,
         updated_ms INTEGER NOT NULL
     );
     CREATE UNIQUE INDEX items_by_event ON items (instance, event_id);
     CREATE INDEX items_by_conversation ON items (instance, conversation, thread, id);
     CREATE INDEX items_unhandled ON items (instance, handled_ms, id);
     CREATE INDEX items_by_age ON items (updated_ms);",
    // 6 (issue 18): indexes a message's state changes move less. Every state change of an
    // inbound entry moved its entries in `inbound_by_state` and `inbound_by_age` (both keyed
    // on columns each change rewrites), and every change of a reply moved its entry in
    // `replies_by_conversation`. Now only entries still open are indexed by state (a settled
    // one leaves the small index once), the age index is on the arrival time (written once),
    // and a reply's conversation index holds only the replies that hold their conversation.
    // The predicates are spelled exactly as the queries spell them (`OPEN_INBOUND`,
    // `replies::holding`, respelled by migration 10): SQLite uses a partial index only for a
    // query that repeats it.
    "DROP INDEX inbound_by_state;
     DROP INDEX inbound_by_age;
     CREATE INDEX inbound_open ON inbound (state, instance)
         WHERE state IN ('running', 'replied');
     CREATE INDEX inbound_by_received ON inbound (received_ms);
     DROP INDEX replies_by_conversation;
     CREATE INDEX replies_holding ON replies (instance, conversation, id)
         WHERE state IN ('pending', 'handed', 'failed_retryable');",
    // 7 (issue 18): four indexes fewer to write per message. `history_by_event` had no
    // reader, and `items_unhandled` none the planner picked (the listing reads the items
    // newest first by id); `history_by_age` and `items_by_age` served only the retention
    // prune, which now walks each table from its oldest row (ids grow with arrival) and stops
    // at the first row inside the retention window.
    "DROP INDEX history_by_event;
     DROP INDEX history_by_age;
     DROP INDEX items_by_age;
     DROP INDEX items_unhandled;",
    // 8 (issue 18): `inbound` becomes a rowid table. As a WITHOUT ROWID table it kept each
    // whole row (the frame, the reply: ~700 bytes) in its b-tree's interior pages too, four
    // or five to a page: 2,874 entries made a tree six levels deep, and an insert or update
    // wrote 3.5–6 of its pages. Now rows append to the table in arrival order (their ids),
    // the event ids sit in a small unique index, and pruning walks the rows by id as it does
    // for items and history, so `inbound_by_received` goes. The copy reads the old rows
    // through that index, in arrival order, and sorts only the entries of one millisecond
    // (memory stays bounded on a large ledger); the whole copy is one transaction.
    "CREATE TABLE inbound_rows (
         id INTEGER PRIMARY KEY,
         instance TEXT NOT NULL,
         event_id TEXT NOT NULL,
         content_hash BLOB NOT NULL,
         run_id TEXT NOT NULL,
         state TEXT NOT NULL,
         frame BLOB NOT NULL,
         attempts INTEGER NOT NULL,
         reply TEXT,
         error_code TEXT,
         error_message TEXT,
         received_ms INTEGER NOT NULL,
         updated_ms INTEGER NOT NULL,
         hash_version INTEGER NOT NULL DEFAULT 1
     );
     INSERT INTO inbound_rows (instance, event_id, content_hash, run_id, state, frame, attempts,
         reply, error_code, error_message, received_ms, updated_ms, hash_version)
     SELECT instance, event_id, content_hash, run_id, state, frame, attempts, reply, error_code,
         error_message, received_ms, updated_ms, hash_version
     FROM inbound ORDER BY received_ms, length(run_id), run_id;
     DROP TABLE inbound;
     ALTER TABLE inbound_rows RENAME TO inbound;
     CREATE UNIQUE INDEX inbound_by_event ON inbound (instance, event_id);
     CREATE INDEX inbound_open ON inbound (state, instance)
         WHERE state IN ('running', 'replied');",
    // 9 (issue 18): a reply on its way to a driver (`handed`) is not indexed by state. Nearly
    // every reply is recorded `handed` when its run ends and becomes `posted` when its driver
    // answers, so `replies_by_state` took an entry in the run's end's commit and moved it in
    // the answer's: three page writes per message in two commits. Now the answer's commit
    // writes one. What looks for `handed` replies (a restart, the status counts) reads the
    // small `replies_holding` index of the replies still on their way; the queries on this
    // one repeat its predicate (`replies::NOT_HANDED`).
    "DROP INDEX replies_by_state;
     CREATE INDEX replies_by_state ON replies (state, instance, id) WHERE state <> 'handed';",
    // 10 (issue 18): `replies_holding`'s predicate as comparisons joined by OR. SQLite
    // evaluates an `IN` list of three or more values through an ephemeral table (a b-tree
    // opened, filled and closed), and it evaluates a partial index's predicate on every
    // insert and update of the table: one ephemeral table per reply written, two per reply
    // changed, three per message. The queries repeat the new text (`replies::holding`).
    "DROP INDEX replies_holding;
     CREATE INDEX replies_holding ON replies (instance, conversation, id)
         WHERE (state = 'pending' OR state = 'handed' OR state = 'failed_retryable');",
    // 11 (issue 18): history entries are numbered per conversation and thread (`seq`), and
    // the conversation index is on that number: an append reads the newest number, and
    // keeping a conversation at its cap deletes a range of numbers (`history::append`), with
    // no count of entries kept in a TEMP table beside the rows. Existing entries are
    // numbered in arrival (id) order.
    "ALTER TABLE history ADD COLUMN seq INTEGER NOT NULL DEFAULT 0;
     UPDATE history SET seq = numbered.n
     FROM (SELECT id, row_number() OVER (PARTITION BY instance, conversation, thread ORDER BY id)
               AS n
           FROM history) AS numbered
     WHERE history.id = numbered.id;
     DROP INDEX history_by_conversation;
     CREATE INDEX history_by_conversation ON history (instance, conversation, thread, seq);",
    // 12 (issue 18): history written behind (`history.rs`). The row an entry comes from
    // records the entry's cap and the move generation it was logged in (both NULL: no
    // entry), and `meta.history_moved` the last move's generation and the lowest inbound
    // id a later entry can come from, so the entries a crash left unwritten are rebuilt.
    // Entries written before this migration are all in `history`.
    "ALTER TABLE inbound ADD COLUMN history_cap INTEGER;
     ALTER TABLE inbound ADD COLUMN history_gen INTEGER;
     ALTER TABLE replies ADD COLUMN history_cap INTEGER;
     ALTER TABLE replies ADD COLUMN history_gen INTEGER;
     INSERT INTO meta (key, value)
         SELECT 'history_moved', '0 ' || (coalesce(max(id), 0) + 1) FROM inbound;",
    // 13 (issue 18): inbox items written behind (`items.rs`). The inbound row records its
    // item's id (NULL: no item), and `meta.items_written` the highest item id the last write
    // wrote and the next inbound id then, so the items a crash left unwritten are rebuilt.
    // Items written before this migration are all in `items`.
    "ALTER TABLE inbound ADD COLUMN item_id INTEGER;
     INSERT INTO meta (key, value)
         SELECT 'items_written',
             (SELECT coalesce(max(id), 0) FROM items) || ' ' ||
             (SELECT coalesce(max(id), 0) + 1 FROM inbound);",
    // 14 (issue 18): a reply's delivery record owes it, not its inbound entry. An entry whose
    // run ended with a reply became `replied` and was rewritten `delivered` when the driver
    // answered: the whole row (its frame, its reply) written twice more per message and its
    // `inbound_open` entry moved, then removed. Now the entry settles as the reply's record is
    // made (or as a legacy peer's goes back on its connection), and the answer writes only
    // the record; `replied` is left to replies written before schema 3, which a restart
    // records and settles. Entries still `replied` whose reply has its record settle now.
    "UPDATE inbound SET state = 'delivered'
     WHERE state = 'replied' AND EXISTS (
         SELECT 1 FROM replies AS r
         WHERE r.instance = inbound.instance AND r.event_id = inbound.event_id);",
];

/// How many migrations this build knows (the schema version it writes).
pub const SCHEMA_VERSION: usize = MIGRATIONS.len();

/// How hard each commit pushes to disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Every commit survives power loss (`synchronous = FULL` for every batch).
    Strict,
    /// What a caller or platform was told survives power loss (those batches are fsynced);
    /// the intermediate records (a send's record before its driver answers, a run's start and
    /// end, a reply's claim and its driver's answer) survive a hub crash at once and power
    /// loss with the next fsync, at the latest [`FLUSH_DELAY`](super::store::FLUSH_DELAY)
    /// after the ledger went quiet.
    Full,
    /// `synchronous = NORMAL` in WAL mode: a commit survives a crash of the hub, but the last
    /// commits can be lost on power loss or kernel crash.
    Normal,
}

/// Why the database file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Written by a newer channeld: this build does not know its schema.
    #[error("ledger schema version {found} is newer than this hub understands ({known})")]
    Newer { found: usize, known: usize },
    /// The file is not a SQLite database, or its pages are damaged.
    #[error("the database is corrupted: {0}")]
    Corrupt(String),
    /// The file or its directory cannot be written.
    #[error("the database cannot be written: {0}")]
    ReadOnly(String),
    #[error(transparent)]
    Sql(rusqlite::Error),
}

impl From<rusqlite::Error> for OpenError {
    fn from(err: rusqlite::Error) -> Self {
        use rusqlite::ErrorCode;
        match err.sqlite_error_code() {
            Some(ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt) => {
                OpenError::Corrupt(err.to_string())
            }
            Some(ErrorCode::ReadOnly | ErrorCode::CannotOpen | ErrorCode::PermissionDenied) => {
                OpenError::ReadOnly(err.to_string())
            }
            _ => OpenError::Sql(err),
        }
    }
}

/// Prepared statements the connection keeps: more than the ledger's distinct statements, so
/// none is ever prepared twice (rusqlite's default is 16; one inbound alone runs more).
const STATEMENT_CACHE: usize = 128;

/// Settings that keep the per-message cost of SQLite flat (each was measured, see
/// BENCHMARKS.md "Fix 5"):
/// - the query planner stability guarantee: without it a statement whose plan looked at a
///   bound value (`LIMIT ?`, `OFFSET ?`) is marked to be planned again on every new binding,
///   and rusqlite clears the bindings of every cached statement it hands back, so such a
///   statement was parsed and planned again on every use;
/// - the statement cache above;
/// - statement journals in memory: a call redone after a failure in its batch runs in a
///   savepoint, and its journal spilled to a new temporary file in `/var/tmp` once it
///   outgrew 64 KiB.
fn tune(conn: &Connection) -> rusqlite::Result<()> {
    conn.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)?;
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    conn.pragma_update(None, "temp_store", "MEMORY")
}

/// Opens (or creates) the database file, checks it is whole (`quick_check`), migrates it,
/// and returns it ready for the thread.
pub fn open(path: &Path, durability: Durability) -> Result<Connection, OpenError> {
    // The write-combining layer for the log (`walbuf.rs`); SQLite's own VFS without it.
    let mut conn = match super::walbuf::register() {
        Some(vfs) => Connection::open_with_flags_and_vfs(path, OpenFlags::default(), vfs)?,
        None => Connection::open(path)?,
    };
    conn.pragma_update(None, "journal_mode", "WAL")?;
    let sync = match durability {
        Durability::Strict | Durability::Full => "FULL",
        Durability::Normal => "NORMAL",
    };
    conn.pragma_update(None, "synchronous", sync)?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    conn.busy_timeout(Duration::from_secs(5))?;
    tune(&conn)?;
    quick_check(&conn)?;
    migrate(&mut conn, SCHEMA_VERSION)?;
    Ok(conn)
}

/// `PRAGMA quick_check`: the pages and their structure, without the slower index checks
/// of `integrity_check` (that one is `channeld ledger check`).
fn quick_check(conn: &Connection) -> Result<(), OpenError> {
    let problems = check_with(conn, "quick_check", 5)?;
    if problems.is_empty() { Ok(()) } else { Err(OpenError::Corrupt(problems.join("; "))) }
}

/// Runs `PRAGMA <pragma>(limit)` (`quick_check` or `integrity_check`); the problems it
/// found, none when the database is whole.
pub fn check_with(conn: &Connection, pragma: &str, limit: u32) -> rusqlite::Result<Vec<String>> {
    let mut statement = conn.prepare(&format!("PRAGMA {pragma}({limit})"))?;
    let rows = statement.query_map([], |row| row.get::<_, String>(0))?;
    let mut problems = Vec::new();
    for row in rows {
        let line = row?;
        if line != "ok" {
            problems.push(line);
        }
    }
    Ok(problems)
}

/// The schema version recorded in the database (`PRAGMA user_version`).
pub fn version(conn: &Connection) -> rusqlite::Result<usize> {
    let version: i64 = conn.query_row("PRAGMA user_version", [], |row| row.get(0))?;
    Ok(usize::try_from(version).unwrap_or(0))
}

/// A migrated database in memory: for tests, and for a hub that wants dedupe within one run
/// without a state directory.
pub fn open_in_memory() -> Result<Connection, OpenError> {
    let mut conn = Connection::open_in_memory()?;
    migrate(&mut conn, SCHEMA_VERSION)?;
    Ok(conn)
}

/// Applies the migrations up to `target` (all of them, except in tests of an upgrade).
pub(super) fn migrate(conn: &mut Connection, target: usize) -> Result<(), OpenError> {
    let version = version(conn)?;
    if version > MIGRATIONS.len() {
        return Err(OpenError::Newer { found: version, known: MIGRATIONS.len() });
    }
    for (index, sql) in MIGRATIONS.iter().enumerate().take(target).skip(version) {
        let tx = conn.transaction()?;
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", (index + 1) as i64)?;
        tx.commit()?;
        info!(version = index + 1, "ledger schema migrated");
    }
    Ok(())
}

/// The ledger's id, made once from random bytes: it keeps outbox request ids unique across
/// databases (a hub whose state directory was wiped does not reuse `ob-<id>-1`).
pub fn ledger_id(conn: &Connection) -> rusqlite::Result<String> {
    if let Some(id) = conn
        .query_row("SELECT value FROM meta WHERE key = 'ledger_id'", [], |row| {
            row.get::<_, String>(0)
        })
        .optional()?
    {
        return Ok(id);
    }
    let mut bytes = [0u8; 6];
    getrandom::fill(&mut bytes).map_err(|err| {
        rusqlite::Error::ToSqlConversionFailure(format!("no random bytes: {err}").into())
    })?;
    let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    conn.execute("INSERT INTO meta (key, value) VALUES ('ledger_id', ?1)", params![id])?;
    Ok(id)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// How many ephemeral tables `sql` opens each time it runs (its program's
    /// `OpenEphemeral` instructions).
    pub(crate) fn ephemeral_tables(conn: &Connection, sql: &str) -> usize {
        let mut stmt = conn.prepare(&format!("EXPLAIN {}", unbound(sql))).unwrap();
        let ops = stmt.query_map([], |row| row.get::<_, String>(1)).unwrap();
        ops.map(Result::unwrap).filter(|op| op == "OpenEphemeral").count()
    }

    /// `sql` with each numbered parameter (`?3`) replaced by `NULL`, to be explained.
    pub(crate) fn unbound(sql: &str) -> String {
        let mut out = String::with_capacity(sql.len());
        let mut chars = sql.chars().peekable();
        while let Some(c) = chars.next() {
            if c == '?' && chars.peek().is_some_and(char::is_ascii_digit) {
                while chars.peek().is_some_and(char::is_ascii_digit) {
                    chars.next();
                }
                out.push_str("NULL");
            } else {
                out.push(c);
            }
        }
        out
    }

    /// SQLite checks a partial index's predicate on every insert and update of its table, and
    /// evaluates an `IN` list of three or more values through an ephemeral table: no write a
    /// message makes may build one (schema 10 respelled the one predicate that did).
    #[test]
    fn no_write_to_the_ledger_s_tables_builds_an_ephemeral_table() {
        let conn = open_in_memory().unwrap();
        for sql in [
            "INSERT INTO inbound (instance, event_id, content_hash, run_id, state, frame,
                 attempts, received_ms, updated_ms)
             VALUES ('a.b', 'e1', x'00', 'r', 'running', x'7b7d', 1, 1, 1)",
            "UPDATE inbound SET state = 'replied' WHERE id = 1",
            "INSERT INTO replies (instance, event_id, conversation, message, state, next_ms,
                 expires_ms, created_ms, updated_ms)
             VALUES ('a.b', 'e1', 'c1', x'7b7d', 'handed', 1, 1, 1, 1)",
            "UPDATE replies SET state = 'posted' WHERE id = 1",
            "INSERT INTO outbox (instance, idempotency_key, message, state, created_ms,
                 updated_ms, expires_ms)
             VALUES ('a.b', 'k', x'7b7d', 'sent', 1, 1, 1)",
            "UPDATE outbox SET state = 'receipted' WHERE id = 1",
            "INSERT INTO items (instance, event_id, conversation, received_ms, updated_ms)
             VALUES ('a.b', 'e1', 'c1', 1, 1)",
            "UPDATE items SET handled_ms = 1 WHERE id = 1",
            "INSERT INTO history (instance, conversation, thread, role, text, at_ms, seq)
             VALUES ('a.b', 'c1', '', 'user', 'hi', 1, 1)",
            super::super::history::TRIM,
        ] {
            assert_eq!(ephemeral_tables(&conn, sql), 0, "{sql}");
        }
        let holding: String = conn
            .query_row("SELECT sql FROM sqlite_master WHERE name = 'replies_holding'", [], |r| {
                r.get(0)
            })
            .unwrap();
        assert!(holding.ends_with(&format!("WHERE {}", super::super::replies::holding(""))));
    }

    /// Migration 14: an entry that owed a reply with a delivery record settles; one without
    /// a record (from before schema 3, or a legacy peer's from an earlier version) still
    /// owes it.
    #[test]
    fn a_version_13_ledger_settles_the_entries_whose_reply_has_its_record() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn, 13).unwrap();
        for event in ["tracked", "untracked", "running"] {
            let state = if event == "running" { "running" } else { "replied" };
            conn.execute(
                "INSERT INTO inbound (instance, event_id, content_hash, hash_version, run_id,
                     state, frame, attempts, reply, received_ms, updated_ms)
                 VALUES ('a.b', ?1, x'01', 2, ?1, ?2, x'7b7d', 1, 'hi', 5, 5)",
                [event, state],
            )
            .unwrap();
        }
        conn.execute(
            "INSERT INTO replies (instance, event_id, conversation, message, state, next_ms,
                 expires_ms, created_ms, updated_ms)
             VALUES ('a.b', 'tracked', 'c1', x'7b7d', 'handed', 5, 5, 5, 5)",
            [],
        )
        .unwrap();
        migrate(&mut conn, SCHEMA_VERSION).unwrap();
        let states: Vec<(String, String, i64)> = conn
            .prepare("SELECT event_id, state, updated_ms FROM inbound ORDER BY id")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let expected = [("tracked", "delivered"), ("untracked", "replied"), ("running", "running")]
            .map(|(event, state)| (event.to_owned(), state.to_owned(), 5));
        assert_eq!(states, expected);
    }

    #[test]
    fn a_version_1_ledger_is_migrated_and_its_entries_marked_hash_version_1() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn, 1).unwrap();
        conn.execute(
            "INSERT INTO inbound (instance, event_id, content_hash, run_id, state, frame,
                 attempts, received_ms, updated_ms)
             VALUES ('a.b', 'e1', x'00', 'run-e1', 'delivered', x'7b7d', 1, 1, 1)",
            [],
        )
        .unwrap();
        migrate(&mut conn, SCHEMA_VERSION).unwrap();
        let version: i64 = conn
            .query_row("SELECT hash_version FROM inbound WHERE event_id = 'e1'", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, 1);
        let user_version: i64 =
            conn.query_row("PRAGMA user_version", [], |row| row.get(0)).unwrap();
        assert_eq!(user_version as usize, SCHEMA_VERSION);
    }

    #[test]
    fn a_version_7_ledger_keeps_its_inbound_entries_in_arrival_order_as_rows() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn, 7).unwrap();
        // Inserted out of arrival order; two in one millisecond (`run-…-9` came first).
        for (event, run, received) in
            [("e3", "run-x-1", 30), ("e1", "run-x-10", 10), ("e0", "run-x-9", 10)]
        {
            conn.execute(
                "INSERT INTO inbound (instance, event_id, content_hash, hash_version, run_id,
                     state, frame, attempts, reply, received_ms, updated_ms)
                 VALUES ('a.b', ?1, x'01', 2, ?2, 'replied', x'7b7d', 1, 'hi', ?3, ?3)",
                params![event, run, received],
            )
            .unwrap();
        }
        migrate(&mut conn, SCHEMA_VERSION).unwrap();
        let rows: Vec<(i64, String, u32, Option<String>)> = conn
            .prepare("SELECT id, event_id, hash_version, reply FROM inbound ORDER BY id")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let events: Vec<_> = rows.iter().map(|r| r.1.as_str()).collect();
        assert_eq!(events, ["e0", "e1", "e3"]);
        assert!(rows.iter().all(|r| r.2 == 2 && r.3.as_deref() == Some("hi")));
        let sql: String = conn
            .query_row("SELECT sql FROM sqlite_schema WHERE name = 'inbound'", [], |r| r.get(0))
            .unwrap();
        assert!(!sql.contains("WITHOUT ROWID"), "{sql}");
        // The event id stays unique.
        let again = conn.execute(
            "INSERT INTO inbound (instance, event_id, content_hash, run_id, state, frame,
                 attempts, received_ms, updated_ms)
             VALUES ('a.b', 'e1', x'00', 'r', 'running', x'00', 0, 40, 40)",
            [],
        );
        assert!(again.is_err());
    }

    #[test]
    fn a_version_8_ledger_indexes_only_its_replies_at_rest_by_state() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn, 8).unwrap();
        for (event, state) in [("e1", "handed"), ("e2", "posted"), ("e3", "pending")] {
            conn.execute(
                "INSERT INTO replies (instance, event_id, conversation, message, state, next_ms,
                     expires_ms, created_ms, updated_ms)
                 VALUES ('a.b', ?1, 'c', x'7b7d', ?2, 0, 100, 0, 0)",
                params![event, state],
            )
            .unwrap();
        }
        migrate(&mut conn, SCHEMA_VERSION).unwrap();
        let indexed: Vec<String> = conn
            .prepare("SELECT state FROM replies INDEXED BY replies_by_state WHERE state <> 'handed' ORDER BY state")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(indexed, ["pending", "posted"]);
        let txn = conn.transaction().unwrap();
        let mut counts: Vec<_> = super::super::replies::counts(&txn)
            .unwrap()
            .into_iter()
            .map(|c| (c.state.as_str(), c.count))
            .collect();
        counts.sort_unstable();
        assert_eq!(counts, [("handed", 1), ("pending", 1), ("posted", 1)]);
    }

    #[test]
    fn a_version_10_ledger_numbers_its_history_per_conversation_in_arrival_order() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn, 10).unwrap();
        // Two conversations interleaved, one with a thread; ids give the arrival order.
        for (id, conversation, thread, text) in [
            (5, "c1", "", "c1 first"),
            (6, "c2", "", "c2 first"),
            (9, "c1", "", "c1 second"),
            (10, "c1", "t", "c1/t first"),
            (12, "c1", "", "c1 third"),
        ] {
            conn.execute(
                "INSERT INTO history (id, instance, conversation, thread, role, text, at_ms)
                 VALUES (?1, 'a.b', ?2, ?3, 'user', ?4, 1)",
                params![id, conversation, thread, text],
            )
            .unwrap();
        }
        migrate(&mut conn, SCHEMA_VERSION).unwrap();
        let numbered: Vec<(String, i64)> = conn
            .prepare("SELECT text, seq FROM history ORDER BY id")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let numbered: Vec<(&str, i64)> = numbered.iter().map(|(t, n)| (t.as_str(), *n)).collect();
        assert_eq!(
            numbered,
            [
                ("c1 first", 1),
                ("c2 first", 1),
                ("c1 second", 2),
                ("c1/t first", 1),
                ("c1 third", 3)
            ]
        );
        // The next append goes on from the newest number, and reads see arrival order.
        let txn = conn.transaction().unwrap();
        let next = super::super::history::NewHistory {
            instance: "a.b".into(),
            conversation: "c1".into(),
            thread: None,
            role: channeld_protocol::ext::HistoryRole::User,
            text: "c1 fourth".into(),
            sender: None,
            message_id: None,
            event_id: None,
            reply_id: None,
            at_ms: 2,
        };
        super::super::history::append(&txn, &next, 200).unwrap();
        let seq: i64 = txn
            .query_row("SELECT seq FROM history WHERE text = 'c1 fourth'", [], |r| r.get(0))
            .unwrap();
        assert_eq!(seq, 4);
        let texts: Vec<String> = super::super::history::recent(&txn, "a.b", "c1", None, 10)
            .unwrap()
            .into_iter()
            .map(|e| e.text)
            .collect();
        assert_eq!(texts, ["c1 first", "c1 second", "c1 third", "c1 fourth"]);
    }

    #[test]
    fn a_newer_schema_is_refused() {
        let mut conn = Connection::open_in_memory().unwrap();
        conn.pragma_update(None, "user_version", (SCHEMA_VERSION + 1) as i64).unwrap();
        let err = migrate(&mut conn, SCHEMA_VERSION).unwrap_err().to_string();
        assert!(err.contains("newer than this hub understands"), "{err}");
    }

    #[test]
    fn the_ledger_id_is_made_once() {
        let conn = open_in_memory().unwrap();
        let id = ledger_id(&conn).unwrap();
        assert_eq!(id.len(), 12);
        assert_eq!(ledger_id(&conn).unwrap(), id);
    }
}
