//! Answer: the classification and rules in, the disposal steps out, written as a stream of
//! text that the runner coalesces into delta events.

use ecoscan_proto::v1::{GenerateRequest, Stage, generate_response::Event};

use super::{Call, Calls, StageDef, StageMsg, input, messages};
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
            model: job.model.clone(),
        };
        let mut client = calls.clients.answer.clone();
        let response = client.generate(calls.request(job, req)).await;
        messages(response, |m| {
            m.event.map(|e| match e {
                Event::Progress(p) => StageMsg::Progress(before_the_text(p)),
                Event::Delta(d) => StageMsg::Delta(d),
                Event::Answer(a) => StageMsg::Output(Box::new(Checkpoint::Answer(a))),
            })
        })
    })
}

/// The answer's share of the job's progress measures its text: the runner places each delta
/// by the characters written so far, from the start of the stage's range. A step the service
/// reports before the text (composing the prompt) therefore sits at that start, or the first
/// delta would move the job's progress backwards (0.535 -> 0.518).
fn before_the_text(p: ecoscan_proto::v1::Progress) -> ecoscan_proto::v1::Progress {
    ecoscan_proto::v1::Progress { fraction: 0.0, ..p }
}
