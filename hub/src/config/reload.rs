//! What a re-read configuration changes for a running hub, decided without I/O: instances to
//! serve and to stop, instances whose live settings change, and the keys whose new values
//! only a restart applies (README lists them).

use std::sync::Arc;
use std::time::Duration;

use channeld_protocol::ChannelId;

use super::{Allowlist, HubConfig, InstanceConfig, RuntimeConfig};

/// An instance's settings that apply live: read as each message arrives or run starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstancePolicy {
    pub allow: Allowlist,
    pub deny_notice: Option<String>,
    pub deny_notice_interval: Duration,
    /// The runtime the instance's runs use (its whole definition: a changed command counts).
    pub runtime: Arc<RuntimeConfig>,
    /// Conversation history: the entries kept per conversation; `None`: off.
    pub history: Option<usize>,
}

impl HubConfig {
    /// The live settings of `instance` under this configuration.
    pub fn policy_of(&self, instance: &InstanceConfig) -> InstancePolicy {
        InstancePolicy {
            allow: instance.allow.clone(),
            deny_notice: instance.deny_notice.clone(),
            deny_notice_interval: instance.deny_notice_interval,
            runtime: self.runtime_for(instance).clone(),
            history: instance.history,
        }
    }
}

/// What to do to go from the running configuration to a new one.
#[derive(Debug, Clone)]
pub struct Reload {
    /// Instances to bind and serve.
    pub added: Vec<InstanceConfig>,
    /// Instances to stop: their drivers are told `stop` and their sockets removed.
    pub removed: Vec<ChannelId>,
    /// Instances that stay, with the live settings they take.
    pub changed: Vec<(ChannelId, InstancePolicy)>,
    /// Keys whose new values are not applied: they need a restart.
    pub restart_only: Vec<String>,
    /// The configuration the hub runs once this is applied: the new one, except for the
    /// values that need a restart (the next reload compares against this).
    pub applied: HubConfig,
}

impl Reload {
    /// True when applying this changes nothing.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.changed.is_empty()
    }
}

/// Plans going from `running` to `new` (both validated).
pub fn plan(running: &HubConfig, new: &HubConfig) -> Reload {
    let mut restart_only: Vec<String> = [
        ("hub.runtime_dir", running.runtime_dir != new.runtime_dir),
        ("hub.state_dir", running.state_dir != new.state_dir),
        ("hub.durability", running.durability != new.durability),
        ("hub.cpu_scheduling", running.cpu_scheduling != new.cpu_scheduling),
        ("hub.retention_days", running.retention != new.retention),
        ("hub.outbox_ttl_secs", running.outbox_ttl != new.outbox_ttl),
        ("hub.reply_ttl_secs", running.reply_ttl != new.reply_ttl),
        ("hub.control_socket", running.control_socket != new.control_socket),
        ("hub.control_allow_uids/control_allow_gids", running.control_peers != new.control_peers),
        ("hub.receipt_timeout_secs", running.receipt_timeout != new.receipt_timeout),
        ("hub.command_timeout_secs", running.command_timeout != new.command_timeout),
        (
            "hub.health_probe_interval_secs",
            running.health_probe_interval != new.health_probe_interval,
        ),
        ("hub.health_probe_timeout_secs", running.health_probe_timeout != new.health_probe_timeout),
        ("hub.liveness_secs", running.liveness != new.liveness),
        ("hub.stall_timeout_secs", running.stall_timeout != new.stall_timeout),
        ("hub.drain_timeout_secs", running.drain_timeout != new.drain_timeout),
        ("hub.agent_env_wait_secs", running.agent_env_wait != new.agent_env_wait),
        ("hub.metrics_listen", running.metrics_listen != new.metrics_listen),
        ("hub.amqp_sends", running.amqp_sends != new.amqp_sends),
    ]
    .into_iter()
    .filter(|(_, differs)| *differs)
    .map(|(key, _)| key.to_owned())
    .collect();

    let mut applied = HubConfig {
        runtimes: new.runtimes.clone(),
        instances: Vec::with_capacity(new.instances.len()),
        ..running.clone()
    };
    let (mut added, mut changed) = (Vec::new(), Vec::new());
    for wanted in &new.instances {
        let Some(current) = running.instances.iter().find(|i| i.id == wanted.id) else {
            added.push(wanted.clone());
            applied.instances.push(wanted.clone());
            continue;
        };
        let key = format!("instance.\"{}\"", wanted.id);
        for (field, differs) in [
            ("socket", current.socket != wanted.socket),
            ("spawn", current.spawn != wanted.spawn),
            ("spawn_env", current.spawn_env != wanted.spawn_env),
            ("identity_isolation", current.identity_isolation != wanted.identity_isolation),
            ("max_inflight", current.max_inflight != wanted.max_inflight),
            ("max_queued", current.max_queued != wanted.max_queued),
            ("allow_uids/allow_gids", current.peers != wanted.peers),
        ] {
            if differs {
                restart_only.push(format!("{key}.{field}"));
            }
        }
        let kept = InstanceConfig {
            allow: wanted.allow.clone(),
            deny_notice: wanted.deny_notice.clone(),
            deny_notice_interval: wanted.deny_notice_interval,
            runtime: wanted.runtime.clone(),
            history: wanted.history,
            ..current.clone()
        };
        let policy = applied.policy_of(&kept);
        if policy != running.policy_of(current) {
            changed.push((kept.id.clone(), policy));
        }
        applied.instances.push(kept);
    }
    let removed = running
        .instances
        .iter()
        .filter(|current| !new.instances.iter().any(|i| i.id == current.id))
        .map(|current| current.id.clone())
        .collect();
    Reload { added, removed, changed, restart_only, applied }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::{CpuScheduling, Overrides};

    fn config(text: &str) -> HubConfig {
        HubConfig::parse(text, Path::new("t.toml"), &Overrides::default()).unwrap()
    }

    const BASE: &str = "[runtime.agent]\nkind = \"exec\"\ncommand = [\"/bin/a\"]\n\
                        [instance.\"a.one\"]\nallow = [\"alice\"]\n\
                        [instance.\"a.two\"]\nallow = [\"bob\"]\nruntime = \"agent\"\n";

    #[test]
    fn the_same_configuration_changes_nothing() {
        let running = config(BASE);
        let reload = plan(&running, &config(BASE));
        assert!(reload.is_empty());
        assert!(reload.restart_only.is_empty());
    }

    #[test]
    fn allowlists_deny_notices_and_runtimes_change_live() {
        let running = config(BASE);
        let new = config(
            "[runtime.agent]\nkind = \"exec\"\ncommand = [\"/bin/b\"]\n\
             [instance.\"a.one\"]\nallow = [\"carol\"]\ndeny_notice = \"no\"\n\
             [instance.\"a.two\"]\nallow = [\"bob\"]\nruntime = \"agent\"\n",
        );
        let reload = plan(&running, &new);
        let ids: Vec<&str> = reload.changed.iter().map(|(id, _)| id.as_str()).collect();
        // a.one: allowlist and notice; a.two: its runtime's command.
        assert_eq!(ids, vec!["a.one", "a.two"]);
        let (_, one) = &reload.changed[0];
        assert_eq!(one.allow, Allowlist::Senders(vec!["carol".into()]));
        assert_eq!(one.deny_notice.as_deref(), Some("no"));
        assert_eq!(reload.changed[1].1.runtime.command, vec!["/bin/b".to_owned()]);
        assert!(reload.added.is_empty() && reload.removed.is_empty());
        assert!(reload.restart_only.is_empty());
        // Once applied, the same file changes nothing more.
        assert!(plan(&reload.applied, &new).is_empty());
    }

    #[test]
    fn instances_are_added_and_removed() {
        let running = config(BASE);
        let new = config("[instance.\"a.one\"]\nallow = [\"alice\"]\n[instance.\"a.three\"]\n");
        let reload = plan(&running, &new);
        assert_eq!(reload.added.iter().map(|i| i.id.as_str()).collect::<Vec<_>>(), ["a.three"]);
        assert_eq!(reload.removed.iter().map(ChannelId::as_str).collect::<Vec<_>>(), ["a.two"]);
        assert!(reload.changed.is_empty());
        let ids: Vec<&str> = reload.applied.instances.iter().map(|i| i.id.as_str()).collect();
        assert_eq!(ids, ["a.one", "a.three"]);
    }

    #[test]
    fn restart_only_keys_are_named_and_keep_their_running_values() {
        let running = config(BASE);
        let new = config(
            "[hub]\nreceipt_timeout_secs = 3\ncpu_scheduling = \"inherit\"\n[runtime.agent]\nkind = \"exec\"\ncommand = [\"/bin/a\"]\n\
             [instance.\"a.one\"]\nallow = [\"carol\"]\nmax_inflight = 2\nsocket = \"/tmp/x.sock\"\n\
             [instance.\"a.two\"]\nallow = [\"bob\"]\nruntime = \"agent\"\n",
        );
        let reload = plan(&running, &new);
        assert_eq!(
            reload.restart_only,
            [
                "hub.cpu_scheduling",
                "hub.receipt_timeout_secs",
                "instance.\"a.one\".socket",
                "instance.\"a.one\".max_inflight"
            ]
        );
        assert_eq!(reload.applied.receipt_timeout, running.receipt_timeout);
        assert_eq!(reload.applied.cpu_scheduling, CpuScheduling::Batch);
        let one = &reload.applied.instances[0];
        assert_eq!(one.max_inflight, running.instances[0].max_inflight);
        assert_eq!(one.socket, running.instances[0].socket);
        assert_eq!(one.allow, Allowlist::Senders(vec!["carol".into()]), "the live part applies");
        // They stay pending (and named) until a restart; nothing else changes again.
        let again = plan(&reload.applied, &new);
        assert!(again.is_empty());
        assert_eq!(again.restart_only.len(), 4);
    }
}
