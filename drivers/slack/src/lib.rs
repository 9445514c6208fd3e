//! The Slack driver as a library, so its tests can use the layers directly.
//!
//! * [`config`]: `CHANNELD_SLACK_*` settings and the two tokens, validated.
//! * [`wire`]: Slack's Socket Mode, Events API, interactivity and Web API formats.
//! * [`convert`]: pure mapping between Slack events and channeld frames.
//! * [`envelopes`]: each Socket Mode envelope reported and acknowledged after the hub's answer.
//! * [`live`]: pure bookkeeping of previews, typing and assistant threads.
//! * [`mrkdwn`]: agent Markdown to Slack mrkdwn, and splitting long replies.
//! * [`blocks`]: commands as Block Kit messages, and clicks back to results.
//! * [`commands`]: commands waiting for a click.
//! * [`seen`]: inbound ids the hub already answered (answer once).
//! * [`pacing`]: about one post per second per channel.
//! * [`platform`]: the [`SlackDriver`] (declaration, posts, effects, commands).
//! * [`socket`]: the Socket Mode loop (sockets, refresh, acks after the hub's answer).
//! * [`outbound`]: posts, previews, typing, reactions, edits and deletions on Slack.
//! * [`web`]: the Web API client, with Slack's answers classified.

pub mod blocks;
pub mod commands;
pub mod config;
pub mod convert;
pub mod envelopes;
pub mod live;
pub mod mrkdwn;
pub mod outbound;
pub mod pacing;
pub mod platform;
pub mod seen;
pub mod socket;
pub mod web;
pub mod wire;

pub use config::SlackConfig;
pub use platform::SlackDriver;
