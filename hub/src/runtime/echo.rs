//! The built-in echo runtime: replies to a message with its own text; events get no reply.

use super::{RunInput, RunOutput, RunRequest};

pub(super) fn run(request: &RunRequest) -> RunOutput {
    match &request.input {
        RunInput::Message { message } => {
            let body = &message.body;
            let mut text = body.text_str().to_owned();
            for attachment in body.attachments() {
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(&attachment.url);
            }
            RunOutput { reply: Some(text), ..RunOutput::default() }
        }
        RunInput::Event { .. } => RunOutput::default(),
    }
}
