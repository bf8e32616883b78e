//! Vision: the photo in, a classification out, with its progress on the way.

use ecoscan_proto::v1::{ClassifyRequest, Stage, classify_response::Event};

use super::{Call, Calls, StageDef, StageMsg, messages};
use crate::error::StoreError;
use crate::store::{Job, jobs::Checkpoint};

pub(super) const STAGE: StageDef = StageDef {
    stage: Stage::Vision,
    completed: "classified",
    missing: "vision ended its stream without a classification",
    stored: |job| job.classification.clone().map(Checkpoint::Classification),
    call,
};

fn call<'a>(calls: &'a Calls<'a>, job: &'a Job) -> Call<'a> {
    Box::pin(async move {
        let image = calls
            .objects
            .get(&job.image_key)
            .await
            .map_err(StoreError::from)?
            .ok_or_else(|| {
                StoreError::Corrupt(format!(
                    "image {} of job {} is missing",
                    job.image_key, job.id
                ))
            })?;
        let req = ClassifyRequest {
            job_id: job.id.clone(),
            image: image.to_vec(),
            content_type: job.content_type.clone(),
            hint: job.hint.clone(),
            model: job.model.clone(),
        };
        let mut client = calls.clients.vision.clone();
        let response = client.classify(calls.request(job, req)).await;
        messages(response, |m| {
            m.event.map(|e| match e {
                Event::Progress(p) => StageMsg::Progress(p),
                Event::Classification(c) => {
                    StageMsg::Output(Box::new(Checkpoint::Classification(c)))
                }
            })
        })
    })
}
