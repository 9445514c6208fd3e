//! Typed driver settings: one [`ConfigError`] that names the variable, and the [`Setting`]
//! trait that parses a variable's text into a value (numbers, booleans, durations, URLs,
//! paths, strings).
//!
//! A driver reads its settings through [`DriverLaunchConfig`](crate::DriverLaunchConfig):
//! `launch.require::<Url>("SLACK_API_URL")?`, `launch.parse_or("PREFETCH", 16u16)?`,
//! `launch.parse_within("TIMEOUT_SECONDS", Duration::from_secs(1)..=Duration::from_secs(600))?`.
//! An empty variable counts as unset. Errors never quote a value (it might be a secret).

use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::time::Duration;

use url::Url;

/// Why the settings are unusable. Every variant names the variable (or credential), so the
/// operator knows what to fix; none contains a value. A driver that fails with one exits 78
/// (`EX_CONFIG`), which systemd and the hub's supervisor do not restart.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A required variable is not set (or is empty).
    #[error("{var} is not set")]
    Missing { var: String },
    /// A variable is set to something unusable.
    #[error("{var} is invalid: {reason}")]
    Invalid { var: String, reason: String },
    /// Two variables for the same setting (a channeld name and its reference alias) say
    /// different things.
    #[error("{var} and {other} disagree: {reason}")]
    Conflict { var: String, other: String, reason: String },
    /// A credential file exists but cannot be used.
    #[error("credential {name} {reason}")]
    Credential { name: String, reason: String },
}

impl ConfigError {
    /// `var` is not set.
    pub fn missing(var: impl Into<String>) -> Self {
        ConfigError::Missing { var: var.into() }
    }

    /// `var` is set to something unusable, because `reason`.
    pub fn invalid(var: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::Invalid { var: var.into(), reason: reason.into() }
    }

    /// The variable or credential the error is about.
    pub fn variable(&self) -> &str {
        match self {
            ConfigError::Missing { var }
            | ConfigError::Invalid { var, .. }
            | ConfigError::Conflict { var, .. } => var,
            ConfigError::Credential { name, .. } => name,
        }
    }
}

/// A value a setting's text parses into.
///
/// Implemented for strings, paths, booleans (`true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off`),
/// integers, [`Duration`] (seconds, fractions allowed, or a number with `ms`, `s`, `m` or `h`)
/// and [`Url`]. Implement it for a driver's own types (an enum of modes, say) to read them with
/// the same calls and errors.
pub trait Setting: Sized {
    /// What a valid value looks like, for error messages (`"a whole number"`).
    const EXPECTED: &'static str;

    /// Parses the variable's text (already trimmed, never empty). The error is a reason
    /// without the value itself.
    fn parse_setting(raw: &str) -> Result<Self, String>;
}

impl Setting for String {
    const EXPECTED: &'static str = "text";

    fn parse_setting(raw: &str) -> Result<Self, String> {
        Ok(raw.to_owned())
    }
}

impl Setting for PathBuf {
    const EXPECTED: &'static str = "a path";

    fn parse_setting(raw: &str) -> Result<Self, String> {
        if raw.contains('\0') {
            return Err("a path cannot contain NUL".into());
        }
        Ok(PathBuf::from(raw))
    }
}

impl Setting for bool {
    const EXPECTED: &'static str = "true or false";

    fn parse_setting(raw: &str) -> Result<Self, String> {
        match raw.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Ok(true),
            "false" | "0" | "no" | "off" => Ok(false),
            _ => Err(format!("expected {}", Self::EXPECTED)),
        }
    }
}

macro_rules! integer_setting {
    ($($ty:ty),+) => {$(
        impl Setting for $ty {
            const EXPECTED: &'static str = "a whole number";

            fn parse_setting(raw: &str) -> Result<Self, String> {
                raw.parse::<$ty>().map_err(|_| {
                    format!("expected a whole number from {} to {}", <$ty>::MIN, <$ty>::MAX)
                })
            }
        }
    )+};
}

integer_setting!(u8, u16, u32, u64, usize, i32, i64);

impl Setting for Duration {
    const EXPECTED: &'static str = "a duration";

    fn parse_setting(raw: &str) -> Result<Self, String> {
        const UNITS: [(&str, f64); 4] = [("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)];
        let expected = || {
            "expected a duration: seconds (e.g. 30 or 0.5) or a number with ms, s, m or h"
                .to_owned()
        };
        let (number, scale) = UNITS
            .iter()
            .find_map(|(unit, scale)| raw.strip_suffix(unit).map(|n| (n.trim_end(), *scale)))
            .unwrap_or((raw, 1.0));
        let value: f64 = number.parse().map_err(|_| expected())?;
        if !value.is_finite() || value < 0.0 {
            return Err(expected());
        }
        Duration::try_from_secs_f64(value * scale).map_err(|_| expected())
    }
}

impl Setting for Url {
    const EXPECTED: &'static str = "a URL";

    fn parse_setting(raw: &str) -> Result<Self, String> {
        // url's errors describe the problem without repeating the input.
        Url::parse(raw).map_err(|err| format!("not a URL: {err}"))
    }
}

/// Parses `raw` (the value of `var`) as a `T`.
pub(crate) fn parse_value<T: Setting>(var: &str, raw: &str) -> Result<T, ConfigError> {
    T::parse_setting(raw.trim()).map_err(|reason| ConfigError::invalid(var, reason))
}

/// Checks that `value` of `var` lies in `range`.
pub(crate) fn check_range<T: Setting + PartialOrd + std::fmt::Debug>(
    var: &str,
    value: T,
    range: &RangeInclusive<T>,
) -> Result<T, ConfigError> {
    if range.contains(&value) {
        return Ok(value);
    }
    Err(ConfigError::invalid(
        var,
        format!("expected {} from {:?} to {:?}", T::EXPECTED, range.start(), range.end()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_seconds_or_a_unit() {
        let cases = [
            ("30", Duration::from_secs(30)),
            ("0.5", Duration::from_millis(500)),
            ("250ms", Duration::from_millis(250)),
            ("2s", Duration::from_secs(2)),
            ("1.5 m", Duration::from_secs(90)),
            ("1h", Duration::from_secs(3600)),
        ];
        for (raw, expected) in cases {
            assert_eq!(Duration::parse_setting(raw), Ok(expected), "{raw}");
        }
        for bad in ["soon", "-1", "1d", "NaN", "inf", "ms"] {
            assert!(Duration::parse_setting(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn booleans_take_the_usual_spellings() {
        for yes in ["true", "TRUE", "1", "yes", "on"] {
            assert_eq!(bool::parse_setting(yes), Ok(true), "{yes}");
        }
        for no in ["false", "0", "No", "off"] {
            assert_eq!(bool::parse_setting(no), Ok(false), "{no}");
        }
        assert_eq!(bool::parse_setting("maybe"), Err("expected true or false".into()));
    }

    #[test]
    fn errors_name_the_variable_and_the_expected_form_but_never_the_value() {
        let err = parse_value::<u16>("CHANNELD_X", "70000-secret").unwrap_err();
        assert_eq!(
            err.to_string(),
            "CHANNELD_X is invalid: expected a whole number from 0 to 65535"
        );
        let err = parse_value::<Url>("CHANNELD_URL", "http://u:hunter2@[::1").unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
        assert_eq!(err.variable(), "CHANNELD_URL");
        let err = check_range("CHANNELD_N", 0u16, &(1..=256)).unwrap_err();
        assert_eq!(err.to_string(), "CHANNELD_N is invalid: expected a whole number from 1 to 256");
        assert_eq!(ConfigError::missing("CHANNELD_Y").to_string(), "CHANNELD_Y is not set");
    }
}
