//! Operator actions (extension `operator_action`): an operator asks the connected driver to
//! do something only a person can decide (`resume`, `login`). The hub refuses what the driver
//! did not declare without contacting it, then waits for the driver's one answer.

use std::time::Duration;

use channeld_protocol::frame::{OperatorActionFrame, OperatorActionResult};
use channeld_protocol::{Frame, Id};

use crate::connection::Connection;

/// Why an operator action got no answer from the driver, or was refused before reaching it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OperatorError {
    /// The driver did not negotiate the `operator_action` extension.
    #[error("the driver does not take operator actions")]
    NotNegotiated,
    /// The driver did not list this name in `hello.operator_actions`.
    #[error("the driver did not declare the operator action {name} (it declares: {declared})")]
    NotDeclared { name: String, declared: String },
    #[error("the action's arguments must be a JSON object")]
    ArgsNotObject,
    #[error("driver disconnected before answering")]
    Disconnected,
    #[error("no answer from the driver within {0} s")]
    Timeout(u64),
    #[error("the action could not be sent: {0}")]
    Send(String),
}

/// Whether `name` may be sent to a driver that negotiated `negotiated` and declared
/// `declared`. Pure.
pub fn gate(
    negotiated: bool,
    declared: &[String],
    name: &str,
    args: &serde_json::Value,
) -> Result<(), OperatorError> {
    if !negotiated {
        return Err(OperatorError::NotNegotiated);
    }
    if !declared.iter().any(|d| d == name) {
        let declared = if declared.is_empty() { "none".to_owned() } else { declared.join(", ") };
        return Err(OperatorError::NotDeclared { name: name.to_owned(), declared });
    }
    if !args.is_object() {
        return Err(OperatorError::ArgsNotObject);
    }
    Ok(())
}

/// Sends the action to `conn` and waits up to `timeout` for its result.
pub async fn perform(
    conn: &Connection,
    request_id: Id,
    name: String,
    args: serde_json::Value,
    timeout: Duration,
) -> Result<OperatorActionResult, OperatorError> {
    gate(conn.declaration.extensions.operator_action, &conn.operator_actions, &name, &args)?;
    let waiter =
        conn.expect_operator_action(request_id.clone()).ok_or(OperatorError::Disconnected)?;
    let frame =
        Frame::OperatorAction(OperatorActionFrame { request_id: request_id.clone(), name, args });
    if let Err(err) = conn.sink.send(&frame).await {
        conn.forget_operator_action(&request_id);
        return Err(OperatorError::Send(err.to_string()));
    }
    // Closing the connection drops the waiter's sender: the wait ends at once.
    match tokio::time::timeout(timeout, waiter).await {
        Ok(Ok(result)) => Ok(result),
        Ok(Err(_)) => Err(OperatorError::Disconnected),
        Err(_) => {
            conn.forget_operator_action(&request_id);
            Err(OperatorError::Timeout(timeout.as_secs()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_declared_names_with_object_args_pass_the_gate() {
        let declared = vec!["resume".to_owned(), "login".to_owned()];
        let args = serde_json::json!({});
        assert_eq!(gate(true, &declared, "resume", &args), Ok(()));
        assert_eq!(gate(false, &declared, "resume", &args), Err(OperatorError::NotNegotiated));
        let err = gate(true, &declared, "wipe", &args).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the driver did not declare the operator action wipe (it declares: resume, login)"
        );
        let none = gate(true, &[], "resume", &args).unwrap_err();
        assert!(none.to_string().ends_with("(it declares: none)"), "{none}");
        let list = serde_json::json!([1]);
        assert_eq!(gate(true, &declared, "login", &list), Err(OperatorError::ArgsNotObject));
    }
}
