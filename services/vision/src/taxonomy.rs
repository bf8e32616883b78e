//! The taxonomy from the rule service, fetched on first use and kept.

use std::{collections::HashSet, sync::Arc, time::Duration};

use ecoscan_common::client::TracedChannel;
use ecoscan_llm::TaxonomyPath;
use ecoscan_proto::v1::{ListCategoriesRequest, rule_service_client::RuleServiceClient};
use tokio::sync::Mutex;

use crate::error::Error;

const FETCH_DEADLINE: Duration = Duration::from_secs(5);

/// Every path a classification may answer with, and the situation-tag vocabulary.
#[derive(Debug)]
pub(crate) struct Taxonomy {
    pub paths: Vec<TaxonomyPath>,
    pub situation_tags: Vec<String>,
    known: HashSet<(String, String, String)>,
    tag_set: HashSet<String>,
}

impl Taxonomy {
    pub(crate) fn contains(&self, major: &str, middle: &str, minor: &str) -> bool {
        self.known
            .contains(&(major.to_owned(), middle.to_owned(), minor.to_owned()))
    }

    pub(crate) fn has_tag(&self, tag: &str) -> bool {
        self.tag_set.contains(tag)
    }
}

/// Fetches the taxonomy once; a failed fetch is not cached, so the next request tries again.
pub(crate) struct TaxonomyCache {
    url: String,
    client: RuleServiceClient<TracedChannel>,
    cached: Mutex<Option<Arc<Taxonomy>>>,
}

impl TaxonomyCache {
    pub(crate) fn new(url: &str) -> anyhow::Result<Self> {
        Ok(Self {
            url: url.to_owned(),
            client: RuleServiceClient::new(ecoscan_common::client::channel(url)?),
            cached: Mutex::new(None),
        })
    }

    pub(crate) async fn get(&self) -> Result<Arc<Taxonomy>, Error> {
        // Held across the fetch so that concurrent first requests make one call, not many.
        let mut cached = self.cached.lock().await;
        if let Some(t) = cached.as_ref() {
            return Ok(t.clone());
        }
        let taxonomy = Arc::new(self.fetch().await?);
        tracing::info!(
            paths = taxonomy.paths.len(),
            tags = taxonomy.situation_tags.len(),
            "taxonomy loaded from the rule service"
        );
        *cached = Some(taxonomy.clone());
        Ok(taxonomy)
    }

    async fn fetch(&self) -> Result<Taxonomy, Error> {
        let response = self
            .client
            .clone()
            .list_categories(ecoscan_common::client::request(
                ListCategoriesRequest {},
                FETCH_DEADLINE,
            ))
            .await
            .map_err(|s| Error::RuleUnavailable {
                url: self.url.clone(),
                reason: format!(
                    "{}: {}",
                    ecoscan_common::codes::code_name(s.code()),
                    s.message()
                ),
            })?
            .into_inner();
        let mut paths = Vec::new();
        for c in response.categories {
            if c.items.is_empty() {
                // A category without items is still a valid answer at its own level.
                paths.push(TaxonomyPath {
                    major: c.major_category.clone(),
                    middle: c.middle_category.clone(),
                    minor: String::new(),
                    name_en: c.name_en.clone(),
                });
            }
            for item in c.items {
                paths.push(TaxonomyPath {
                    major: c.major_category.clone(),
                    middle: c.middle_category.clone(),
                    minor: item,
                    name_en: c.name_en.clone(),
                });
            }
        }
        if paths.is_empty() {
            return Err(Error::EmptyTaxonomy(self.url.clone()));
        }
        Ok(Taxonomy {
            known: paths
                .iter()
                .map(|p| (p.major.clone(), p.middle.clone(), p.minor.clone()))
                .collect(),
            tag_set: response.situation_tags.iter().cloned().collect(),
            situation_tags: response.situation_tags,
            paths,
        })
    }
}
