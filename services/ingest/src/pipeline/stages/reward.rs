//! Reward: the classification and rules in, the collectible character decision out (one
//! unary call).

use ecoscan_proto::v1::{EvaluateRequest, Stage};
use tonic::Status;

use super::{Call, Calls, Messages, StageDef, StageError, StageMsg, input};
use crate::store::{Job, jobs::Checkpoint};

pub(super) const STAGE: StageDef = StageDef {
    stage: Stage::Reward,
    completed: "reward evaluated",
    missing: "reward answered without a decision",
    stored: |job| job.reward.clone().map(Checkpoint::Reward),
    call,
};

fn call<'a>(calls: &'a Calls<'a>, job: &'a Job) -> Call<'a> {
    Box::pin(async move {
        let req = EvaluateRequest {
            job_id: job.id.clone(),
            classification: Some(input(&job.classification, "classification", Stage::Reward)?),
            rules: Some(input(&job.rules, "rules", Stage::Reward)?),
        };
        let mut client = calls.clients.reward.clone();
        let decision = client
            .evaluate(calls.request(job, req))
            .await
            .map_err(StageError::from)?
            .into_inner()
            .decision
            .ok_or_else(|| Status::internal(STAGE.missing))?;
        let messages: Messages = Box::pin(tokio_stream::once(Ok(StageMsg::Output(Box::new(
            Checkpoint::Reward(decision),
        )))));
        Ok(messages)
    })
}
