//! The `RewardService` RPCs: evaluating a scan for a character, listing what a user owns, and
//! the catalogue with the user's ownership.

use std::sync::Arc;

use ecoscan_common::{
    identity::{IdentityError, caller, valid_user_id},
    metrics::Labels1,
};
use ecoscan_proto::{
    now_us, timestamp_from_us as from_us,
    v1::{
        CatalogueEntry, Character, EvaluateRequest, EvaluateResponse, GetCharacterRequest,
        GetCharacterResponse, ListCatalogueRequest, ListCatalogueResponse, ListOwnedRequest,
        ListOwnedResponse, OwnedCharacter, RewardDecision, reward_service_server::RewardService,
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
            // A recyclable item whose middle category has no character of its own earns the
            // default one.
            Some(_) => Ok(self
                .catalogue
                .for_category(&classification.middle_category)
                .unwrap_or_else(|| self.catalogue.default_character())),
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

    /// The whole catalogue, each character with `user_id`'s ownership of it.
    pub async fn catalogue(&self, user_id: &str) -> Result<Vec<CatalogueEntry>, Error> {
        let owned = self.owned_by_code(user_id).await?;
        Ok(self
            .catalogue
            .all()
            .map(|c| self.entry(c, &owned))
            .collect())
    }

    /// The character `name` names (code, Korean or English name) with `user_id`'s ownership.
    pub async fn character(&self, user_id: &str, name: &str) -> Result<CatalogueEntry, Error> {
        if name.trim().is_empty() {
            return Err(Error::EmptyCharacterName);
        }
        let character = self
            .catalogue
            .find(name)
            .ok_or_else(|| Error::NoSuchCharacter(name.trim().to_owned()))?;
        let owned = self.owned_by_code(user_id).await?;
        Ok(self.entry(character, &owned))
    }

    async fn owned_by_code(
        &self,
        user_id: &str,
    ) -> Result<std::collections::HashMap<String, crate::store::OwnedRow>, Error> {
        if !valid_user_id(user_id) {
            return Err(Error::Identity(IdentityError::Invalid));
        }
        Ok(self
            .store
            .list_owned(user_id)
            .await?
            .into_iter()
            .map(|row| (row.character_code.clone(), row))
            .collect())
    }

    fn entry(
        &self,
        character: &Character,
        owned: &std::collections::HashMap<String, crate::store::OwnedRow>,
    ) -> CatalogueEntry {
        let row = owned.get(&character.code);
        CatalogueEntry {
            character: Some(character.clone()),
            is_default: self.catalogue.is_default(&character.code),
            owned: row.is_some(),
            acquired_at: row.map(|r| from_us(r.acquired_at_us)),
            job_id: row.map(|r| r.job_id.clone()).unwrap_or_default(),
        }
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

    #[tracing::instrument(skip_all, fields(user.id))]
    async fn list_catalogue(
        &self,
        request: Request<ListCatalogueRequest>,
    ) -> Result<Response<ListCatalogueResponse>, Status> {
        let user = caller(request.metadata()).map_err(Error::from)?;
        tracing::Span::current().record("user.id", user.as_str());
        let characters = Reward::catalogue(self, &user).await?;
        Ok(Response::new(ListCatalogueResponse { characters }))
    }

    #[tracing::instrument(skip_all, fields(user.id))]
    async fn get_character(
        &self,
        request: Request<GetCharacterRequest>,
    ) -> Result<Response<GetCharacterResponse>, Status> {
        let user = caller(request.metadata()).map_err(Error::from)?;
        tracing::Span::current().record("user.id", user.as_str());
        let entry = Reward::character(self, &user, &request.get_ref().name).await?;
        Ok(Response::new(GetCharacterResponse { entry: Some(entry) }))
    }
}
