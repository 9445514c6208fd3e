//! A real Nostr relay for tests (nostr-relay-builder's `LocalRelay`, in this test process on a
//! loopback port), and a test client with its own keys that writes to the driver and reads
//! what the driver writes back.
//!
//! [`TestRelay`] lifts the builder's default rate limit (60 events a minute per connection),
//! keeps its events in a database the test can count, can be stopped and started again on
//! the same port with the same events, and can play a relay that refuses direct messages or
//! never answers them. It runs on the test's tokio runtime.
//!
//! [`NostrTestClient`] sends NIP-17 and NIP-04 messages (and the malformed ones a relay may
//! carry: undecryptable wraps, forged seals, backdated wraps), waits for each relay's `OK`,
//! and collects the direct messages addressed to it.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use nostr_relay_builder::builder::{PolicyResult, RateLimit, WritePolicy};
use nostr_relay_builder::{LocalRelay, RelayBuilder};
use nostr_sdk::nips::nip04;
use nostr_sdk::nips::nip44;
use nostr_sdk::nips::nip59::UnwrappedGift;
use nostr_sdk::prelude::{BoxedFuture, MemoryDatabase, MemoryDatabaseOptions, NostrDatabase};
use nostr_sdk::{
    Client, Event, EventBuilder, EventId, Filter, Keys, Kind, PublicKey, RelayPoolNotification,
    Tag, Timestamp, ToBech32, UnsignedEvent,
};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// How long a relay may take to listen again on its port after a stop.
const REBIND_WITHIN: Duration = Duration::from_secs(10);
/// Direct messages a test client buffers.
const RECEIVED_BUFFER: usize = 4096;

/// How a test relay treats direct messages (kinds 4 and 1059; everything else is stored).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Behaviour {
    /// Stores them and answers `OK true`.
    Store,
    /// Answers `OK false` with this reason.
    Refuse(String),
    /// Never answers (the connection's session waits forever on them).
    Silent,
}

#[derive(Debug)]
struct DirectMessagePolicy(Behaviour);

impl WritePolicy for DirectMessagePolicy {
    fn admit_event<'a>(
        &'a self,
        event: &'a Event,
        _addr: &'a SocketAddr,
    ) -> BoxedFuture<'a, PolicyResult> {
        Box::pin(async move {
            let direct = matches!(event.kind, Kind::GiftWrap | Kind::EncryptedDirectMessage);
            match &self.0 {
                Behaviour::Refuse(reason) if direct => PolicyResult::Reject(reason.clone()),
                Behaviour::Silent if direct => std::future::pending().await,
                _ => PolicyResult::Accept,
            }
        })
    }
}

/// A relay on `127.0.0.1` in this process. Shut down on drop.
#[derive(Debug)]
pub struct TestRelay {
    relay: Option<LocalRelay>,
    port: u16,
    database: Arc<MemoryDatabase>,
    behaviour: Behaviour,
}

impl TestRelay {
    /// A relay that stores everything.
    pub async fn start() -> Self {
        Self::start_with(Behaviour::Store).await
    }

    pub async fn start_with(behaviour: Behaviour) -> Self {
        let database = Arc::new(MemoryDatabase::with_opts(MemoryDatabaseOptions {
            events: true,
            max_events: Some(100_000),
        }));
        let port = free_port();
        let mut relay = Self { relay: None, port, database, behaviour };
        relay.start_again().await;
        relay
    }

    /// `ws://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("ws://127.0.0.1:{}", self.port)
    }

    /// Stops listening and closes every connection; the events stay.
    pub fn stop(&mut self) {
        if let Some(relay) = self.relay.take() {
            relay.shutdown();
        }
    }

    /// Listens again on the same port with the same events.
    pub async fn start_again(&mut self) {
        self.stop();
        let deadline = tokio::time::Instant::now() + REBIND_WITHIN;
        loop {
            let builder = RelayBuilder::default()
                .addr([127, 0, 0, 1].into())
                .port(self.port)
                .database(self.database.clone())
                .rate_limit(RateLimit { max_reqs: 10_000, notes_per_minute: 1_000_000 })
                .write_policy(DirectMessagePolicy(self.behaviour.clone()));
            let relay = LocalRelay::new(builder);
            match relay.run().await {
                Ok(()) => {
                    self.relay = Some(relay);
                    return;
                }
                Err(err) if tokio::time::Instant::now() < deadline => {
                    // The previous listener may not have let go of the port yet.
                    let _ = err;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(err) => panic!("the test relay cannot listen on port {}: {err}", self.port),
            }
        }
    }

    /// The stored events matching `filter`.
    pub async fn events(&self, filter: Filter) -> Vec<Event> {
        let events = self.database.query(filter).await.expect("query the test relay");
        events.into_iter().collect()
    }

    /// How many stored events match `filter`.
    pub async fn count(&self, filter: Filter) -> usize {
        self.database.count(filter).await.expect("count in the test relay")
    }

    /// Direct messages (wraps and kind 4) stored for `to`.
    pub async fn direct_messages_to(&self, to: &PublicKey) -> usize {
        let filter =
            Filter::new().kinds([Kind::GiftWrap, Kind::EncryptedDirectMessage]).pubkey(*to);
        self.count(filter).await
    }
}

impl Drop for TestRelay {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A loopback port nothing listens on right now.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).expect("bind a free port");
    listener.local_addr().expect("local addr").port()
}

/// A direct message the test client received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// 17 or 4.
    pub nip: u8,
    /// The rumor's id (NIP-17) or the event's id (NIP-04).
    pub id: EventId,
    pub kind: Kind,
    pub sender: PublicKey,
    pub text: String,
    /// The message it answers (its `e` tag).
    pub reply_to: Option<EventId>,
}

/// A Nostr user with its own keys, connected to some relays.
#[derive(Debug)]
pub struct NostrTestClient {
    pub keys: Keys,
    client: Client,
    received: mpsc::Receiver<Received>,
    reader: JoinHandle<()>,
}

impl NostrTestClient {
    /// A new identity on `relays`, reading the direct messages addressed to it.
    pub async fn connect(relays: &[String]) -> Self {
        Self::connect_as(Keys::generate(), relays).await
    }

    pub async fn connect_as(keys: Keys, relays: &[String]) -> Self {
        let client = Client::new(keys.clone());
        for relay in relays {
            client.add_relay(relay.as_str()).await.expect("add relay");
        }
        client.try_connect(Duration::from_secs(10)).await;
        let mut notifications = client.notifications();
        let since = Timestamp::from_secs(Timestamp::now().as_secs().saturating_sub(3 * 86_400));
        let filter = Filter::new()
            .kinds([Kind::GiftWrap, Kind::EncryptedDirectMessage])
            .pubkey(keys.public_key())
            .since(since);
        client.subscribe(filter, None).await.expect("subscribe");
        let (tx, received) = mpsc::channel(RECEIVED_BUFFER);
        let reader_keys = keys.clone();
        let reader = tokio::spawn(async move {
            let mut seen = HashSet::new();
            while let Ok(notification) = notifications.recv().await {
                let RelayPoolNotification::Event { event, .. } = notification else { continue };
                if let Some(message) = open(&reader_keys, &event).await
                    && seen.insert(message.id)
                    && tx.send(message).await.is_err()
                {
                    return;
                }
            }
        });
        Self { keys, client, received, reader }
    }

    pub fn public_key(&self) -> PublicKey {
        self.keys.public_key()
    }

    pub fn npub(&self) -> String {
        self.keys.public_key().to_bech32().expect("npub")
    }

    /// Publishes `event` and asserts at least one relay stored it.
    pub async fn publish(&self, event: &Event) {
        let output = self.client.send_event(event).await.expect("publish");
        assert!(
            !output.success.is_empty(),
            "no relay stored the test's event: {:?}",
            output.failed
        );
    }

    /// Sends a NIP-17 direct message; returns the rumor's id (the message id).
    pub async fn send_nip17(&self, to: PublicKey, text: &str) -> EventId {
        let rumor = EventBuilder::private_msg_rumor(to, text).build(self.public_key());
        self.send_rumor(to, rumor, None).await
    }

    /// Sends a NIP-17 message whose gift wrap is dated `age` in the past.
    pub async fn send_nip17_backdated(&self, to: PublicKey, text: &str, age: Duration) -> EventId {
        let rumor = EventBuilder::private_msg_rumor(to, text).build(self.public_key());
        let at = Timestamp::from_secs(Timestamp::now().as_secs() - age.as_secs());
        self.send_rumor(to, rumor, Some(at)).await
    }

    async fn send_rumor(
        &self,
        to: PublicKey,
        mut rumor: UnsignedEvent,
        at: Option<Timestamp>,
    ) -> EventId {
        let id = rumor.id();
        let seal = EventBuilder::seal(&self.keys, &to, rumor)
            .await
            .expect("seal")
            .sign_with_keys(&self.keys)
            .expect("sign seal");
        let wrap = wrap_seal(&to, &seal, at);
        self.publish(&wrap).await;
        id
    }

    /// A gift wrap whose rumor claims to be written by `claimed` while this client signs the
    /// seal: a forgery the receiver must refuse.
    pub async fn send_forged_seal(&self, to: PublicKey, claimed: PublicKey, text: &str) {
        let rumor = EventBuilder::private_msg_rumor(to, text).build(claimed);
        let seal = EventBuilder::seal(&self.keys, &to, rumor)
            .await
            .expect("seal")
            .sign_with_keys(&self.keys)
            .expect("sign seal");
        self.publish(&wrap_seal(&to, &seal, None)).await;
    }

    /// A kind-1059 event for `to` whose content decrypts to nothing.
    pub async fn send_garbage_wrap(&self, to: PublicKey) {
        let event = EventBuilder::new(Kind::GiftWrap, "this is not a NIP-44 payload")
            .tag(Tag::public_key(to))
            .sign_with_keys(&Keys::generate())
            .expect("sign");
        self.publish(&event).await;
    }

    /// Sends a NIP-04 direct message; returns its event id.
    pub async fn send_nip04(&self, to: PublicKey, text: &str) -> EventId {
        let ciphertext = nip04::encrypt(self.keys.secret_key(), &to, text).expect("encrypt");
        let event = EventBuilder::new(Kind::EncryptedDirectMessage, ciphertext)
            .tag(Tag::public_key(to))
            .sign_with_keys(&self.keys)
            .expect("sign");
        self.publish(&event).await;
        event.id
    }

    /// The next direct message, failing the test after `within`.
    pub async fn next_message(&mut self, within: Duration) -> Received {
        self.next_within(within)
            .await
            .unwrap_or_else(|| panic!("no direct message arrived within {within:?}"))
    }

    /// The next direct message, or `None` after `within`.
    pub async fn next_within(&mut self, within: Duration) -> Option<Received> {
        tokio::time::timeout(within, self.received.recv()).await.ok().flatten()
    }
}

impl Drop for NostrTestClient {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// A gift wrap of `seal` for `to`, signed by a throwaway key, dated `at` (default: now).
fn wrap_seal(to: &PublicKey, seal: &Event, at: Option<Timestamp>) -> Event {
    let ephemeral = Keys::generate();
    let content = nip44::encrypt(
        ephemeral.secret_key(),
        to,
        serde_json::to_string(seal).expect("seal json"),
        nip44::Version::default(),
    )
    .expect("encrypt seal");
    EventBuilder::new(Kind::GiftWrap, content)
        .tag(Tag::public_key(*to))
        .custom_created_at(at.unwrap_or_else(Timestamp::now))
        .sign_with_keys(&ephemeral)
        .expect("sign wrap")
}

/// A direct message addressed to `keys`, opened; `None` for anything else.
async fn open(keys: &Keys, event: &Event) -> Option<Received> {
    match event.kind {
        Kind::GiftWrap => {
            let gift = UnwrappedGift::from_gift_wrap(keys, event).await.ok()?;
            let mut rumor = gift.rumor;
            Some(Received {
                nip: 17,
                id: rumor.id(),
                kind: rumor.kind,
                sender: gift.sender,
                text: rumor.content.clone(),
                reply_to: rumor.tags.event_ids().next().copied(),
            })
        }
        Kind::EncryptedDirectMessage => {
            let text = nip04::decrypt(keys.secret_key(), &event.pubkey, &event.content).ok()?;
            Some(Received {
                nip: 4,
                id: event.id,
                kind: event.kind,
                sender: event.pubkey,
                text,
                reply_to: event.tags.event_ids().next().copied(),
            })
        }
        _ => None,
    }
}
