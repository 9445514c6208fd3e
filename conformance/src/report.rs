//! Check results and how they are shown: one `PASS|FAIL|SKIP name: reason` line each, or one
//! JSON document with `--json`; and the exit status they add up to.

use serde_json::json;

/// Exit status: every check that ran passed (skipped ones do not count against it).
pub const EXIT_PASSED: u8 = 0;
/// Exit status: at least one check failed.
pub const EXIT_FAILED: u8 = 1;
/// Exit status: the command line was unusable (clap uses the same).
pub const EXIT_USAGE: u8 = 2;
/// Exit status: the kit could not run at all (no temp dir or socket, the command cannot start).
pub const EXIT_CANNOT_RUN: u8 = 3;

/// What a check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Pass,
    Fail,
    /// Not applicable to this driver, or not checkable in this run; never a failure.
    Skip,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pass => "PASS",
            Status::Fail => "FAIL",
            Status::Skip => "SKIP",
        }
    }
}

/// One check's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckResult {
    pub name: &'static str,
    pub status: Status,
    pub reason: String,
}

impl CheckResult {
    pub fn pass(name: &'static str, reason: impl Into<String>) -> Self {
        Self { name, status: Status::Pass, reason: reason.into() }
    }

    pub fn fail(name: &'static str, reason: impl Into<String>) -> Self {
        Self { name, status: Status::Fail, reason: reason.into() }
    }

    pub fn skip(name: &'static str, reason: impl Into<String>) -> Self {
        Self { name, status: Status::Skip, reason: reason.into() }
    }

    /// `PASS name: reason`, on one line whatever the reason holds.
    pub fn line(&self) -> String {
        let reason = self.reason.replace(['\n', '\r'], " ");
        format!("{} {}: {reason}", self.status.as_str(), self.name)
    }
}

/// The exit status for a finished run.
pub fn exit_status(results: &[CheckResult]) -> u8 {
    if results.iter().any(|r| r.status == Status::Fail) { EXIT_FAILED } else { EXIT_PASSED }
}

/// The `--json` document: every check in order, counts, and whether the driver passed.
pub fn to_json(results: &[CheckResult]) -> serde_json::Value {
    let count = |status| results.iter().filter(|r| r.status == status).count();
    let checks: Vec<_> = results
        .iter()
        .map(|r| json!({"name": r.name, "status": r.status.as_str(), "reason": r.reason}))
        .collect();
    json!({
        "passed": exit_status(results) == EXIT_PASSED,
        "counts": {"pass": count(Status::Pass), "fail": count(Status::Fail), "skip": count(Status::Skip)},
        "checks": checks,
    })
}

/// `12 passed, 1 failed, 2 skipped`.
pub fn summary(results: &[CheckResult]) -> String {
    let count = |status| results.iter().filter(|r| r.status == status).count();
    format!(
        "{} passed, {} failed, {} skipped",
        count(Status::Pass),
        count(Status::Fail),
        count(Status::Skip)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_per_check_and_skips_do_not_fail_the_run() {
        let results = vec![
            CheckResult::pass("hello", "hello for a.b"),
            CheckResult::skip("deliver_once", "no --inject\ncommand"),
        ];
        assert_eq!(results[1].line(), "SKIP deliver_once: no --inject command");
        assert_eq!(exit_status(&results), EXIT_PASSED);
        let mut failed = results.clone();
        failed.push(CheckResult::fail("sigterm", "exit status 1"));
        assert_eq!(exit_status(&failed), EXIT_FAILED);
        assert_eq!(summary(&failed), "1 passed, 1 failed, 1 skipped");
    }

    #[test]
    fn the_json_document_lists_checks_in_order() {
        let results =
            vec![CheckResult::pass("hello", "ok"), CheckResult::fail("health", "no answer")];
        let doc = to_json(&results);
        assert_eq!(doc["passed"], false);
        assert_eq!(doc["counts"]["fail"], 1);
        assert_eq!(
            doc["checks"][1],
            json!({"name": "health", "status": "FAIL", "reason": "no answer"})
        );
    }
}
