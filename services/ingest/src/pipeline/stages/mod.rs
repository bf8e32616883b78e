//! The stage table. Each stage is a file of its own that knows its service's API and nothing
//! of the event log: it turns the job (and the outputs earlier stages checkpointed on it) into
//! its request, and its response into [`StageMsg`]s, which the runner appends, coalesces and
//! checkpoints. The runner walks [`STAGES`] in order and skips a stage whose output is on the
//! row already (a resumed job).

mod answer;
mod reward;
mod rule;
mod vision;

use std::{future::Future, pin::Pin, time::Duration};

use ecoscan_common::{client::request_as, codes};
use ecoscan_proto::v1::{Progress, Stage, scan_event::Payload};
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

use super::StageClients;
use crate::{
    error::StoreError,
    event::stage_name,
    store::{Job, ObjectStore, jobs::Checkpoint},
};

/// What a stage's call yields while it runs.
pub(super) enum StageMsg {
    /// A step of the stage's work (an event of its own).
    Progress(Progress),
    /// Answer text as it is written (coalesced into delta events).
    Delta(String),
    /// The stage's result, checkpointed on the row.
    Output(Box<Checkpoint>),
}

/// A running stage call's messages, in order.
pub(super) type Messages = Pin<Box<dyn Stream<Item = Result<StageMsg, Status>> + Send>>;

/// A stage call being made: resolves to its messages once the service has answered.
pub(super) type Call<'a> = Pin<Box<dyn Future<Output = Result<Messages, StageError>> + Send + 'a>>;

/// A streaming stage call's answer as [`StageMsg`]s: the call's failure, or its response
/// stream with `map` turning each response into its message (`None` for one that carries
/// nothing).
fn messages<T: Send + 'static>(
    response: Result<tonic::Response<tonic::Streaming<T>>, Status>,
    map: fn(T) -> Option<StageMsg>,
) -> Result<Messages, StageError> {
    let stream = response?.into_inner();
    Ok(Box::pin(stream.filter_map(move |m| m.map(map).transpose())))
}

/// What a stage call needs besides the job.
pub(super) struct Calls<'a> {
    pub clients: &'a StageClients,
    /// Where the job's photo is.
    pub objects: &'a dyn ObjectStore,
    /// The gRPC deadline of the call.
    pub deadline: Duration,
}

impl Calls<'_> {
    /// `message` as the request of `job`'s stage call: under the call's deadline, made for the
    /// job's user (the stage services act for them).
    /// Made by ingest on its own account too (the assertion's `act` claim), which reward's
    /// `Evaluate` requires: only ingest, for a job it runs, may grant a character.
    fn request<T>(&self, job: &Job, message: T) -> tonic::Request<T> {
        ecoscan_common::client::by_actor(
            request_as(message, self.deadline, &job.user_id),
            ecoscan_common::identity::INGEST_ACTOR,
        )
    }
}

/// One row of the stage table.
pub(super) struct StageDef {
    pub stage: Stage,
    /// The message of its `completed` event.
    pub completed: &'static str,
    /// The error when its call ends without an output.
    pub missing: &'static str,
    /// Its output when the row has it already.
    pub stored: fn(&Job) -> Option<Checkpoint>,
    /// Makes its call.
    pub call: for<'a> fn(&'a Calls<'a>, &'a Job) -> Call<'a>,
}

/// The stages, in the order they run.
pub(super) const STAGES: [StageDef; 4] = [vision::STAGE, rule::STAGE, answer::STAGE, reward::STAGE];

/// A checkpoint as the payload of its stage's `completed` event.
pub(super) fn payload(output: Checkpoint) -> Payload {
    match output {
        Checkpoint::Classification(c) => Payload::Classification(c),
        Checkpoint::Rules(r) => Payload::Rules(r),
        Checkpoint::Answer(a) => Payload::Answer(a),
        Checkpoint::Reward(r) => Payload::Reward(r),
    }
}

/// Puts a stage's output on the job, where later stages read it.
pub(super) fn record(job: &mut Job, output: Checkpoint) {
    match output {
        Checkpoint::Classification(c) => job.classification = Some(c),
        Checkpoint::Rules(r) => job.rules = Some(r),
        Checkpoint::Answer(a) => job.answer = Some(a),
        Checkpoint::Reward(r) => job.reward = Some(r),
    }
}

/// An earlier stage's output that this one takes as input. The runner runs the stages in
/// order, so it is there; were it not, the job fails rather than sends an empty request.
fn input<T: Clone>(value: &Option<T>, what: &str, stage: Stage) -> Result<T, StageError> {
    value.clone().ok_or_else(|| {
        StageError::Call(Status::internal(format!(
            "{} has no {what} to work from",
            stage_name(stage)
        )))
    })
}

/// A stage call's failure: the remote call, or our own storage.
#[derive(Debug, thiserror::Error)]
pub(super) enum StageError {
    #[error("{}: {}", codes::code_name(.0.code()), .0.message())]
    Call(Status),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<Status> for StageError {
    fn from(s: Status) -> Self {
        Self::Call(codes::connection_lost_is_unavailable(s))
    }
}

/// The next message, or `DEADLINE_EXCEEDED` when the stage stays silent for `idle` (a stalled
/// stage must not hold its job forever while the lease keeper keeps it alive).
pub(super) async fn next(
    messages: &mut Messages,
    idle: Duration,
    stage: Stage,
) -> Result<Option<StageMsg>, StageError> {
    match tokio::time::timeout(idle, messages.next()).await {
        Ok(item) => Ok(item.transpose()?),
        Err(_) => Err(StageError::Call(Status::deadline_exceeded(format!(
            "{} sent nothing for {} s",
            stage_name(stage),
            idle.as_secs_f64()
        )))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_connection_lost_mid_call_is_retried_and_a_stage_verdict_is_not() {
        let lost = Status::unknown("h2 protocol error: error reading a body from connection");
        let StageError::Call(lost) = StageError::from(lost) else {
            unreachable!()
        };
        assert_eq!(lost.code(), tonic::Code::Unavailable);
        assert!(codes::worth_retrying(&lost));
        let StageError::Call(cut) = StageError::from(Status::unknown("transport error")) else {
            unreachable!()
        };
        assert_eq!(cut.code(), tonic::Code::Unavailable);
        let StageError::Call(verdict) = StageError::from(Status::unknown("model said no")) else {
            unreachable!()
        };
        assert_eq!(verdict.code(), tonic::Code::Unknown);
    }

    #[test]
    fn the_stages_run_in_pipeline_order_and_each_output_lands_on_its_own_column() {
        let order: Vec<Stage> = STAGES.iter().map(|s| s.stage).collect();
        assert_eq!(
            order,
            [Stage::Vision, Stage::Rule, Stage::Answer, Stage::Reward]
        );
    }
}
