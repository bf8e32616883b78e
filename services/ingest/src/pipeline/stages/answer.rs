//! Answer: the classification and rules in, the disposal steps out, written as a stream of
//! text that the runner coalesces into delta events.

use ecoscan_common::client::request_as;
use ecoscan_proto::v1::{GenerateRequest, Stage, generate_response::Event};

use super::{Call, Calls, StageDef, StageError, StageMsg, input, messages};
use crate::store::{Job, jobs::Checkpoint};

pub(super) const STAGE: StageDef = StageDef {
    stage: Stage::Answer,
    completed: "answer written",
    missing: "answer ended its stream without an answer",
    stored: |job| job.answer.clone().map(Checkpoint::Answer),
    call,
};

fn call<'a>(calls: &'a Calls<'a>, job: &'a Job) -> Call<'a> {
    Box::pin(async move {
        let req = GenerateRequest {
            job_id: job.id.clone(),
            classification: Some(input(&job.classification, "classification", Stage::Answer)?),
            rules: Some(input(&job.rules, "rules", Stage::Answer)?),
            locale: job.locale.clone(),
        };
        let stream = calls
            .clients
            .answer
            .clone()
            .generate(request_as(req, calls.deadline, &job.user_id))
            .await
            .map_err(StageError::from)?
            .into_inner();
        Ok(messages(stream, |m| {
            m.event.map(|e| match e {
                Event::Progress(p) => StageMsg::Progress(p),
                Event::Delta(d) => StageMsg::Delta(d),
                Event::Answer(a) => StageMsg::Output(Box::new(Checkpoint::Answer(a))),
            })
        }))
    })
}
