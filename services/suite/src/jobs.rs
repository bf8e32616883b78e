//! `ecoscan jobs dead-letter list|requeue`: the operator's side of poison jobs, over ingest's
//! `ScanAdminService` (gRPC, with the admin role in the call's metadata; the service is not
//! exposed through the gateway, only on ingest's internal port).

use std::{fmt::Write as _, time::Duration};

use anyhow::Context;
use ecoscan_common::client::{TracedChannel, as_admin, channel};
use ecoscan_proto::v1::{
    DeadLetter, JobStatus, ListDeadLettersRequest, RequeueDeadLetterRequest, Stage,
    scan_admin_service_client::ScanAdminServiceClient,
};

/// How long one admin call may take.
const DEADLINE: Duration = Duration::from_secs(30);

fn client(ingest: &str) -> anyhow::Result<ScanAdminServiceClient<TracedChannel>> {
    Ok(ScanAdminServiceClient::new(channel(ingest).with_context(
        || format!("bad ingest address {ingest:?}"),
    )?))
}

/// A gRPC failure in words an operator can act on.
fn explain(ingest: &str, status: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!(
        "ingest at {ingest} answered {}: {}",
        ecoscan_common::codes::code_name(status.code()),
        status.message()
    )
}

/// Lists dead-lettered jobs, newest first; `before` (RFC 3339) pages back in time.
pub async fn list(ingest: &str, limit: u32, before: Option<&str>) -> anyhow::Result<String> {
    let before = before
        .map(|b| {
            humantime::parse_rfc3339_weak(b).with_context(|| {
                format!("--before {b:?} is not an RFC 3339 time (2026-12-01T13:45:00Z)")
            })
        })
        .transpose()?;
    let mut req = as_admin(ListDeadLettersRequest {
        limit,
        before: before.map(ecoscan_proto::timestamp),
    });
    req.set_timeout(DEADLINE);
    let dead = client(ingest)?
        .list_dead_letters(req)
        .await
        .map_err(|s| explain(ingest, s))?
        .into_inner()
        .dead_letters;
    Ok(render(&dead))
}

/// Puts a dead-lettered job back on the queue; returns a line saying so.
pub async fn requeue(ingest: &str, job_id: &str) -> anyhow::Result<String> {
    let mut req = as_admin(RequeueDeadLetterRequest {
        job_id: job_id.to_owned(),
    });
    req.set_timeout(DEADLINE);
    let job = client(ingest)?
        .requeue_dead_letter(req)
        .await
        .map_err(|s| explain(ingest, s))?
        .into_inner()
        .job
        .context("ingest answered without the job")?;
    Ok(format!(
        "requeued {} (user {}); it resumes at its first stage without a checkpoint\n",
        job.job_id, job.user_id
    ))
}

/// One line per job: when, which, whose, how often it ran, where it stopped, and why.
pub fn render(dead: &[DeadLetter]) -> String {
    if dead.is_empty() {
        return "no dead-lettered jobs\n".to_owned();
    }
    let mut out = String::from("DEAD AT\tJOB\tUSER\tATTEMPTS\tSTAGE\tSTATUS\tERROR\n");
    for d in dead {
        let Some(job) = &d.job else { continue };
        let at = d
            .dead_at
            .as_ref()
            .map(|t| {
                humantime::format_rfc3339_seconds(ecoscan_proto::to_system_time(t)).to_string()
            })
            .unwrap_or_else(|| "-".into());
        let stage = Stage::try_from(job.stage).map_or("?", |s| s.as_str_name());
        let status = JobStatus::try_from(job.status).map_or("?", |s| s.as_str_name());
        let error = job.error.as_ref().map_or("", |e| e.message.as_str());
        // One line per job: tabs and newlines inside the message would break the columns.
        let error: String = error
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        let _ = writeln!(
            out,
            "{at}\t{}\t{}\t{}\t{stage}\t{status}\t{error}",
            job.job_id, job.user_id, d.attempts
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ecoscan_proto::v1::{ErrorInfo, ScanResult};

    #[test]
    fn renders_one_line_per_job_with_why_it_was_set_aside() {
        let dead = DeadLetter {
            job: Some(ScanResult {
                job_id: "01j".into(),
                user_id: "alice".into(),
                status: JobStatus::Failed as i32,
                stage: Stage::Vision as i32,
                error: Some(ErrorInfo {
                    message: "could not\tbe read\nat all".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            attempts: 6,
            dead_at: Some(ecoscan_proto::timestamp(
                std::time::UNIX_EPOCH + Duration::from_secs(1_796_133_912),
            )),
        };
        let out = render(&[dead]);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "{out}");
        assert!(lines[0].starts_with("DEAD AT\tJOB"));
        assert_eq!(
            lines[1],
            "2026-12-01T14:05:12Z\t01j\talice\t6\tSTAGE_VISION\tJOB_STATUS_FAILED\tcould not be read at all"
        );
        assert_eq!(render(&[]), "no dead-lettered jobs\n");
    }
}
