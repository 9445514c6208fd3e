//! What a valid configuration holds that is probably not what was meant: an allowlist that
//! denies everyone, sender ids with stray or invisible characters (they never match what a
//! platform sends).

use super::{Allowlist, HubConfig};

impl HubConfig {
    /// What is valid but probably not what was meant, one sentence each naming its key:
    /// an allowlist that denies everyone, sender ids with stray or invisible characters
    /// (they never match what a platform sends). `channeld check` prints them; the hub logs
    /// them when it starts and on reload.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        for inst in &self.instances {
            let key = format!("instance.\"{}\".allow", inst.id);
            let Allowlist::Senders(ids) = &inst.allow else { continue };
            if ids.is_empty() {
                warnings.push(format!(
                    "{key}: sender allowlist is empty: every inbound message will be denied (set allow = [...] or allow_all = true)"
                ));
            }
            for id in ids {
                if let Some(problem) = sender_id_problem(id) {
                    warnings.push(format!("{key}: {id:?} {problem}"));
                }
            }
        }
        warnings
    }
}

/// Why a sender id cannot be what was meant, if it cannot: surrounding whitespace, or a
/// character nobody sees (controls, zero-width and direction marks, non-ASCII spaces).
fn sender_id_problem(id: &str) -> Option<String> {
    if id.trim() != id {
        return Some("has leading or trailing whitespace".to_owned());
    }
    let hidden = id.chars().find(|c| invisible(*c))?;
    Some(format!("contains an invisible character (U+{:04X})", hidden as u32))
}

fn invisible(c: char) -> bool {
    c.is_control()
        || (c.is_whitespace() && c != ' ')
        || matches!(
            c,
            '\u{00AD}'
                | '\u{034F}'
                | '\u{061C}'
                | '\u{115F}'
                | '\u{1160}'
                | '\u{17B4}'
                | '\u{17B5}'
                | '\u{180B}'..='\u{180F}'
                | '\u{200B}'..='\u{200F}'
                | '\u{202A}'..='\u{202E}'
                | '\u{2060}'..='\u{206F}'
                | '\u{3164}'
                | '\u{FE00}'..='\u{FE0F}'
                | '\u{FEFF}'
                | '\u{FFA0}'
                | '\u{FFF9}'..='\u{FFFB}'
                | '\u{E0000}'..='\u{E007F}'
        )
}
