//! Rule: the classification and the user's locale in, the local disposal rules out.

use ecoscan_proto::v1::{LookupRequest, Stage, lookup_response::Event};

use super::{Call, Calls, StageDef, StageMsg, input, messages};
use crate::store::{Job, jobs::Checkpoint};

pub(super) const STAGE: StageDef = StageDef {
    stage: Stage::Rule,
    completed: "rules found",
    missing: "rule ended its stream without rules",
    stored: |job| job.rules.clone().map(Checkpoint::Rules),
    call,
};

fn call<'a>(calls: &'a Calls<'a>, job: &'a Job) -> Call<'a> {
    Box::pin(async move {
        let req = LookupRequest {
            classification: Some(input(&job.classification, "classification", Stage::Rule)?),
            locale: job.locale.clone(),
        };
        let mut client = calls.clients.rule.clone();
        let response = client.lookup(calls.request(job, req)).await;
        messages(response, |m| {
            m.event.map(|e| match e {
                Event::Progress(p) => StageMsg::Progress(p),
                Event::Rules(r) => StageMsg::Output(Box::new(Checkpoint::Rules(r))),
            })
        })
    })
}
