//! The rule service's settings and where they come from.

use std::path::PathBuf;

use crate::{dataset::Dataset, error::Error};

/// Configuration of the rule service.
///
/// Environment variables:
/// - `RULE_DATASET_PATH` (optional, unset by default): a JSON file in the schema of the embedded
///   `data/rules.json` to use instead of it; validated the same way, and a failure stops startup.
///
/// The binary also reads `RULE_ADDR` (default `127.0.0.1:50053`) for its listen address.
#[derive(Debug, Clone, Default)]
pub struct Config {
    /// Alternative dataset file; `None` uses the dataset compiled into the binary.
    pub dataset_path: Option<PathBuf>,
}

impl Config {
    /// Reads the configuration from the environment (see the type's documentation).
    pub fn from_env() -> anyhow::Result<Self> {
        Ok(Self {
            dataset_path: ecoscan_common::config::env_opt("RULE_DATASET_PATH").map(PathBuf::from),
        })
    }

    /// Loads and validates the configured dataset.
    pub async fn load_dataset(&self) -> Result<Dataset, Error> {
        match &self.dataset_path {
            Some(path) => Dataset::load(path).await,
            None => Dataset::embedded(),
        }
    }
}
