//! The owner's notification when a scan is done.

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use ecoscan_common::{
    client::{TracedChannel, request_as},
    codes,
};
use ecoscan_proto::v1::{
    Classification, NotifyRequest, RewardDecision,
    notification_service_client::NotificationServiceClient,
};
use tonic::Status;

use crate::store::Job;

/// The notification's title and body in the job's locale (Korean unless `en`).
fn text(job: &Job, classification: &Classification, reward: &RewardDecision) -> (String, String) {
    let item = if classification.item_name.is_empty() {
        classification.minor_category.clone()
    } else {
        classification.item_name.clone()
    };
    let character = reward.character.as_ref().filter(|_| reward.newly_granted);
    match (job.locale.as_str(), character) {
        ("en", Some(c)) => (
            "Your scan is ready".to_owned(),
            format!(
                "How to dispose of {item} is ready. New character: {}!",
                c.name_en
            ),
        ),
        ("en", None) => (
            "Your scan is ready".to_owned(),
            format!("How to dispose of {item} is ready."),
        ),
        (_, Some(c)) => (
            "분리배출 안내가 준비됐어요".to_owned(),
            format!(
                "{item} 배출 방법을 확인하세요. 새 캐릭터 {}을(를) 얻었어요!",
                c.name_ko
            ),
        ),
        (_, None) => (
            "분리배출 안내가 준비됐어요".to_owned(),
            format!("{item} 배출 방법을 확인하세요."),
        ),
    }
}

/// Tells the owner the scan finished. Best effort: the scan's result does not depend on it,
/// and the dedupe key makes a repeat after a resume harmless.
pub(super) async fn notify(
    client: &NotificationServiceClient<TracedChannel>,
    job: &Job,
    classification: &Classification,
    reward: &RewardDecision,
) {
    let (title, body) = text(job, classification, reward);
    let req = NotifyRequest {
        kind: "scan_completed".into(),
        title,
        body,
        job_id: job.id.clone(),
        dedupe_key: format!("scan:{}", job.id),
    };
    let call = || {
        let mut client = client.clone();
        let req = req.clone();
        let user = job.user_id.as_str();
        async move {
            client
                .notify(request_as(req, Duration::from_secs(5), user))
                .await
        }
    };
    let sent = call
        .retry(ExponentialBuilder::default().with_max_times(3))
        .when(|s: &Status| codes::retryable(s.code()))
        .await;
    if let Err(status) = sent {
        tracing::warn!(job.id = %job.id, code = ?status.code(), error = %status.message(), "failed to notify the owner");
    }
}
