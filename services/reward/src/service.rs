//! The `RewardService` RPCs: evaluating a scan for a character, listing what a user owns.

use std::sync::Arc;

use ecoscan_common::{
    identity::{IdentityError, caller, valid_user_id},
    metrics::Labels1,
};
use ecoscan_proto::{
    now_us, timestamp_from_us as from_us,
    v1::{
        EvaluateRequest, EvaluateResponse, ListOwnedRequest, ListOwnedResponse, OwnedCharacter,
        RewardDecision, reward_service_server::RewardService,
    },
};
use prometheus_client::metrics::{counter::Counter, family::Family};
use tonic::{Request, Response, Status};

use crate::{
    catalogue::Catalogue,
    error::Error,
    store::{Grant, RewardStore, StoredDecision},
};

/// The RewardService implementation over any [`RewardStore`].
pub struct Reward {
    catalogue: Arc<Catalogue>,
    store: Arc<dyn RewardStore>,
    /// `reward_decisions_total{reason}`.
    decisions: Family<Labels1, Counter>,
}

impl Reward {
    /// A service granting characters from `catalogue`, stored in `store`.
    pub fn new(catalogue: Catalogue, store: Arc<dyn RewardStore>) -> Self {
        Self {
            catalogue: Arc::new(catalogue),
            store,
            decisions: Family::default(),
        }
    }

    /// Counts decisions in `metrics` as `reward_decisions_total{reason}`.
    #[must_use]
    pub fn with_metrics(self, metrics: &mut ecoscan_common::metrics::Metrics) -> Self {
        metrics.registry().register(
            "reward_decisions",
            "Reward decisions returned, by reason (repeats of a job's decision included)",
            self.decisions.clone(),
        );
        self
    }

    /// Decides (and grants) what the scan earns; see the RPC's docs.
    pub async fn evaluate(
        &self,
        user_id: &str,
        req: EvaluateRequest,
    ) -> Result<RewardDecision, Error> {
        if req.job_id.trim().is_empty() {
            return Err(Error::EmptyJobId);
        }
        if !valid_user_id(user_id) {
            return Err(Error::Identity(IdentityError::Invalid));
        }
        let classification = req.classification.ok_or(Error::MissingClassification)?;

        // Ineligible decisions grant nothing and follow from the request alone, so they are
        // not stored; but a replay returns the stored decision whatever it carries this time,
        // so an ineligible request first looks for one. An eligible request goes straight to
        // `grant`, which finds a stored decision itself (one statement fewer per scan).
        let eligible = match &req.rules {
            None => Err("no_rules"),
            Some(rules) if !rules.recyclable => Err("not_recyclable"),
            Some(_) => self
                .catalogue
                .for_category(&classification.middle_category)
                .ok_or("no_character_for_category"),
        };
        let character = match eligible {
            Ok(character) => character,
            Err(reason) => {
                return match self.store.decision(&req.job_id).await? {
                    Some(stored) => self.stored_to_proto(stored, user_id),
                    None => Ok(ineligible(reason)),
                };
            }
        };

        let stored = self
            .store
            .grant(Grant {
                job_id: req.job_id,
                user_id: user_id.to_owned(),
                character_code: character.code.clone(),
                now_us: now_us(),
            })
            .await?;
        self.stored_to_proto(stored, user_id)
    }

    /// Characters `user_id` owns, oldest first.
    pub async fn list_owned(&self, user_id: &str) -> Result<Vec<OwnedCharacter>, Error> {
        if !valid_user_id(user_id) {
            return Err(Error::Identity(IdentityError::Invalid));
        }
        let rows = self.store.list_owned(user_id).await?;
        Ok(rows
            .into_iter()
            .filter_map(|row| {
                let Some(character) = self.catalogue.by_code(&row.character_code) else {
                    tracing::warn!(code = %row.character_code, "owned character is not in the catalogue");
                    return None;
                };
                Some(OwnedCharacter {
                    character: Some(character.clone()),
                    acquired_at: Some(from_us(row.acquired_at_us)),
                    job_id: row.job_id,
                })
            })
            .collect())
    }

    fn stored_to_proto(&self, d: StoredDecision, user_id: &str) -> Result<RewardDecision, Error> {
        if d.user_id != user_id {
            return Err(Error::JobOfAnotherUser(d.job_id));
        }
        let character = d.character_code.as_deref().and_then(|code| {
            let c = self.catalogue.by_code(code);
            if c.is_none() {
                tracing::warn!(code, "decided character is not in the catalogue");
            }
            c.cloned()
        });
        Ok(RewardDecision {
            eligible: d.eligible,
            newly_granted: d.newly_granted,
            character,
            reason: d.reason,
        })
    }
}

fn ineligible(reason: &str) -> RewardDecision {
    RewardDecision {
        eligible: false,
        newly_granted: false,
        character: None,
        reason: reason.to_owned(),
    }
}

#[tonic::async_trait]
impl RewardService for Reward {
    #[tracing::instrument(skip_all, fields(job.id = %request.get_ref().job_id, user.id, reward.reason))]
    async fn evaluate(
        &self,
        request: Request<EvaluateRequest>,
    ) -> Result<Response<EvaluateResponse>, Status> {
        let user = caller(request.metadata()).map_err(Error::from)?;
        tracing::Span::current().record("user.id", user.as_str());
        // Only ingest grants, for a job it runs for this user (the job and its owner are
        // ingest's): a user's own assertion, or another service's, cannot name a job id.
        if ecoscan_common::identity::actor(request.metadata())
            != Some(ecoscan_common::identity::INGEST_ACTOR)
        {
            return Err(Error::NotIngest.into());
        }
        let decision = Reward::evaluate(self, &user, request.into_inner()).await?;
        self.decisions
            .get_or_create(&[("reason", decision.reason.clone())])
            .inc();
        tracing::Span::current().record("reward.reason", decision.reason.as_str());
        tracing::info!(
            eligible = decision.eligible,
            newly_granted = decision.newly_granted,
            "reward decided"
        );
        Ok(Response::new(EvaluateResponse {
            decision: Some(decision),
        }))
    }

    #[tracing::instrument(skip_all, fields(user.id))]
    async fn list_owned(
        &self,
        request: Request<ListOwnedRequest>,
    ) -> Result<Response<ListOwnedResponse>, Status> {
        let user = caller(request.metadata()).map_err(Error::from)?;
        tracing::Span::current().record("user.id", user.as_str());
        let characters = Reward::list_owned(self, &user).await?;
        Ok(Response::new(ListOwnedResponse { characters }))
    }
}
