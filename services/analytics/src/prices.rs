//! What a model call costs: a price table in the format of LiteLLM's
//! `model_prices_and_context_window.json` (so an operator can use that very file), one file
//! per price version, each with the date it takes effect. A call is priced by the version in
//! effect when it started, so a new price never rewrites what earlier calls cost.
//!
//! Money is integer micro-units of the currency (the table's prices are per token, in its
//! currency: US dollars in LiteLLM's file): a price is held as micro-units per million tokens
//! (exactly the table's per-token price times 10^12, rounded once when the table is loaded) and
//! a cost as micro-units, rounded half up once per call. No float is added up anywhere.

use std::{collections::HashMap, path::PathBuf};

use anyhow::{Context, anyhow, bail};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// The setting: comma-separated `[<YYYY-MM-DD>=]<path>` entries, each a price file and the day
/// (UTC) it takes effect; an entry without a date has always been in effect.
pub const PRICES_VAR: &str = "ANALYTICS_PRICES";

/// The version reported for calls of the mock provider, which costs nothing.
pub const MOCK_VERSION: &str = "mock";

/// One model's prices, in micro-units.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Price {
    /// Per million input (prompt) tokens.
    pub input_per_mtok: i64,
    /// Per million output (completion) tokens.
    pub output_per_mtok: i64,
    /// Per million input tokens read from the provider's prompt cache; `None`: priced as
    /// input.
    pub cached_input_per_mtok: Option<i64>,
    /// Per input image, where the provider prices images apart from their tokens.
    pub per_image: i64,
}

/// What one call was: who served it, when, and how much of it there was.
#[derive(Clone, Copy, Debug)]
pub struct Usage<'a> {
    pub provider: &'a str,
    pub model: &'a str,
    pub started_at_us: i64,
    pub input_tokens: i64,
    /// Of `input_tokens`, those read from the prompt cache.
    pub cached_input_tokens: i64,
    pub output_tokens: i64,
    pub images: i64,
}

/// A call's cost and the price version it was computed with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cost {
    pub micros: i64,
    pub version: String,
}

struct Version {
    /// From when it applies, microseconds since the Unix epoch.
    effective_us: i64,
    /// `<effective day>/<first 12 hex digits of the file's SHA-256>`: a changed file is a new
    /// version even on the same day.
    name: String,
    models: HashMap<String, Price>,
}

/// Every price version, oldest first.
#[derive(Default)]
pub struct PriceTable {
    versions: Vec<Version>,
}

impl std::fmt::Debug for PriceTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(
                self.versions
                    .iter()
                    .map(|v| format!("{} ({} models)", v.name, v.models.len())),
            )
            .finish()
    }
}

impl PriceTable {
    /// Reads the files [`PRICES_VAR`] names; unset, the table is empty (every call of a real
    /// provider is recorded with its cost unknown).
    pub fn from_env() -> anyhow::Result<Self> {
        match ecoscan_common::config::env_opt(PRICES_VAR) {
            None => Ok(Self::default()),
            Some(v) => Self::load(&v).with_context(|| format!("invalid {PRICES_VAR} {v:?}")),
        }
    }

    /// Loads the files of a [`PRICES_VAR`] value.
    pub fn load(setting: &str) -> anyhow::Result<Self> {
        let mut versions = Vec::new();
        for entry in setting.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (day, path) = match entry.split_once('=') {
                Some((day, path)) => (Some(day.trim()), PathBuf::from(path.trim())),
                None => (None, PathBuf::from(entry)),
            };
            let effective_us = match day {
                None => i64::MIN,
                Some(day) => day_start_us(day)?,
            };
            let bytes = std::fs::read(&path)
                .with_context(|| format!("cannot read the price file {}", path.display()))?;
            versions.push(
                Self::version(effective_us, day.unwrap_or("always"), &bytes)
                    .with_context(|| format!("price file {}", path.display()))?,
            );
        }
        Self::from_versions(versions)
    }

    /// A table of one version in effect since `day` (`YYYY-MM-DD`, or always when `None`),
    /// from the bytes of a price file.
    pub fn from_json(day: Option<&str>, json: &[u8]) -> anyhow::Result<Self> {
        let effective_us = day.map_or(Ok(i64::MIN), day_start_us)?;
        Self::from_versions(vec![Self::version(
            effective_us,
            day.unwrap_or("always"),
            json,
        )?])
    }

    fn from_versions(mut versions: Vec<Version>) -> anyhow::Result<Self> {
        versions.sort_by_key(|v| v.effective_us);
        if let Some(w) = versions
            .windows(2)
            .find(|w| w[0].effective_us == w[1].effective_us)
        {
            bail!(
                "two price files take effect at the same time ({} and {})",
                w[0].name,
                w[1].name
            );
        }
        Ok(Self { versions })
    }

    fn version(effective_us: i64, day: &str, json: &[u8]) -> anyhow::Result<Version> {
        let doc: Value = serde_json::from_slice(json).context("not JSON")?;
        let Value::Object(entries) = doc else {
            bail!("a price file is one JSON object of models");
        };
        let mut models = HashMap::new();
        for (name, entry) in &entries {
            // LiteLLM's file opens with `sample_spec`, whose values describe the fields.
            if name == "sample_spec" {
                continue;
            }
            if let Some(price) =
                price_of(entry).with_context(|| format!("the prices of {name:?}"))?
            {
                models.insert(name.clone(), price);
            }
        }
        let digest = Sha256::digest(json);
        let hex: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
        Ok(Version {
            effective_us,
            name: format!("{day}/{hex}"),
            models,
        })
    }

    /// How many models the newest version prices.
    pub fn models(&self) -> usize {
        self.versions.last().map_or(0, |v| v.models.len())
    }

    /// The version names, oldest first.
    pub fn versions(&self) -> impl Iterator<Item = &str> {
        self.versions.iter().map(|v| v.name.as_str())
    }

    /// What the call cost; `None` when no version in effect at its start prices its model
    /// (its cost is unknown, never zero). The mock costs nothing.
    pub fn cost(&self, call: &Usage<'_>) -> Option<Cost> {
        if call.provider == MOCK_VERSION {
            return Some(Cost {
                micros: 0,
                version: MOCK_VERSION.to_owned(),
            });
        }
        let (version, price) = self
            .versions
            .iter()
            .rev()
            .filter(|v| v.effective_us <= call.started_at_us)
            .find_map(|v| Some((v, lookup(&v.models, call.provider, call.model)?)))?;
        Some(Cost {
            micros: micros(price, call),
            version: version.name.clone(),
        })
    }
}

/// The model's entry: its name as given, as `<provider>/<name>`, or (for a router's
/// `vendor/model` names) the part after the last `/`.
fn lookup<'a>(
    models: &'a HashMap<String, Price>,
    provider: &str,
    model: &str,
) -> Option<&'a Price> {
    models
        .get(model)
        .or_else(|| models.get(&format!("{provider}/{model}")))
        .or_else(|| models.get(model.rsplit('/').next()?))
}

/// Rounded half up, once, from integer prices.
fn micros(price: &Price, call: &Usage<'_>) -> i64 {
    let cached = call.cached_input_tokens.clamp(0, call.input_tokens.max(0));
    let fresh = call.input_tokens.max(0) - cached;
    let per_mtok = i128::from(fresh) * i128::from(price.input_per_mtok)
        + i128::from(cached)
            * i128::from(price.cached_input_per_mtok.unwrap_or(price.input_per_mtok))
        + i128::from(call.output_tokens.max(0)) * i128::from(price.output_per_mtok);
    let tokens = (per_mtok + 500_000) / 1_000_000;
    let images = i128::from(call.images.max(0)) * i128::from(price.per_image);
    i64::try_from(tokens + images).unwrap_or(i64::MAX)
}

/// A model's prices from its entry; `None` for an entry that prices no tokens (an image
/// generator, a search tool): such models are not called here.
fn price_of(entry: &Value) -> anyhow::Result<Option<Price>> {
    let Value::Object(fields) = entry else {
        bail!("not an object");
    };
    // Per token, in the currency: micro-units per million tokens is that times 10^12.
    let per_token = |key: &str| -> anyhow::Result<Option<i64>> {
        match fields.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => {
                let n = v
                    .as_f64()
                    .ok_or_else(|| anyhow!("{key} is not a number: {v}"))?;
                to_micros(n, 1e12).map(Some).with_context(|| key.to_owned())
            }
        }
    };
    let (Some(input), Some(output)) = (
        per_token("input_cost_per_token")?,
        per_token("output_cost_per_token")?,
    ) else {
        return Ok(None);
    };
    let per_image = match fields.get("input_cost_per_image") {
        None | Some(Value::Null) => 0,
        Some(v) => to_micros(
            v.as_f64()
                .ok_or_else(|| anyhow!("input_cost_per_image is not a number: {v}"))?,
            1e6,
        )
        .context("input_cost_per_image")?,
    };
    Ok(Some(Price {
        input_per_mtok: input,
        output_per_mtok: output,
        cached_input_per_mtok: per_token("cache_read_input_token_cost")?,
        per_image,
    }))
}

fn to_micros(value: f64, scale: f64) -> anyhow::Result<i64> {
    let scaled = (value * scale).round();
    // Finite, not negative, and far inside i64 (NaN is outside every range).
    if !(0.0..=9.0e15).contains(&scaled) {
        bail!("{value} is not a price");
    }
    // In range and integral: the cast is exact.
    #[allow(clippy::cast_possible_truncation)]
    Ok(scaled as i64)
}

/// Midnight UTC of `YYYY-MM-DD`, in microseconds since the epoch.
fn day_start_us(day: &str) -> anyhow::Result<i64> {
    let at = humantime::parse_rfc3339(&format!("{day}T00:00:00Z"))
        .map_err(|e| anyhow!("{day:?} is not a day (YYYY-MM-DD): {e}"))?;
    let us = at
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| anyhow!("{day:?} is before 1970"))?
        .as_micros();
    i64::try_from(us).map_err(|_| anyhow!("{day:?} is too far ahead"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = r#"{
        "sample_spec": {"input_cost_per_token": "a description, not a number"},
        "gpt-4o-mini": {"input_cost_per_token": 1.5e-07, "output_cost_per_token": 6e-07,
                        "cache_read_input_token_cost": 7.5e-08, "litellm_provider": "openai"},
        "gemini/gemini-2.0-flash": {"input_cost_per_token": 1e-07, "output_cost_per_token": 4e-07,
                        "input_cost_per_image": 0.0001},
        "dall-e-3": {"output_cost_per_image": 0.04}
    }"#;

    fn usage<'a>(model: &'a str, input: i64, output: i64) -> Usage<'a> {
        Usage {
            provider: "openai",
            model,
            started_at_us: 1_800_000_000_000_000,
            input_tokens: input,
            cached_input_tokens: 0,
            output_tokens: output,
            images: 0,
        }
    }

    #[test]
    fn a_call_costs_its_tokens_at_the_tables_prices_in_integer_micro_units() {
        let table = PriceTable::from_json(None, TABLE.as_bytes()).unwrap();
        assert_eq!(
            table.models(),
            2,
            "the sample and the image model are not priced"
        );
        // 1,000 in at $0.15/M and 500 out at $0.60/M: $0.00015 + $0.0003 = 450 micro-dollars.
        let cost = table.cost(&usage("gpt-4o-mini", 1000, 500)).unwrap();
        assert_eq!(cost.micros, 450);
        assert!(cost.version.starts_with("always/"), "{}", cost.version);
        // Rounded half up, once: 3 in and 1 out is 0.45 + 0.6 = 1.05 micro-dollars.
        assert_eq!(table.cost(&usage("gpt-4o-mini", 3, 1)).unwrap().micros, 1);
        // Cached input at its own price: 1,000 in, 800 of them cached.
        let cached = Usage {
            cached_input_tokens: 800,
            ..usage("gpt-4o-mini", 1000, 0)
        };
        assert_eq!(table.cost(&cached).unwrap().micros, 90); // 30 + 60
        // Images priced apart, and a router's vendor/model name found as listed.
        let gemini = Usage {
            images: 2,
            ..usage("gemini/gemini-2.0-flash", 10_000, 1000)
        };
        assert_eq!(table.cost(&gemini).unwrap().micros, 1000 + 400 + 200);
        // `openai/gpt-4o-mini` (a LiteLLM route) finds `gpt-4o-mini`.
        assert_eq!(
            table
                .cost(&usage("openai/gpt-4o-mini", 1000, 500))
                .unwrap()
                .micros,
            450
        );
    }

    #[test]
    fn an_unpriced_model_has_no_cost_and_the_mock_costs_nothing() {
        let table = PriceTable::from_json(None, TABLE.as_bytes()).unwrap();
        assert_eq!(table.cost(&usage("gpt-5-unlisted", 10, 10)), None);
        assert_eq!(
            PriceTable::default().cost(&usage("gpt-4o-mini", 10, 10)),
            None
        );
        let mock = Usage {
            provider: "mock",
            ..usage("anything", 10, 10)
        };
        assert_eq!(
            PriceTable::default().cost(&mock),
            Some(Cost {
                micros: 0,
                version: MOCK_VERSION.into()
            })
        );
    }

    #[test]
    fn a_call_keeps_the_price_in_effect_when_it_started() {
        let dir = tempfile::tempdir().unwrap();
        let old = dir.path().join("old.json");
        let new = dir.path().join("new.json");
        std::fs::write(
            &old,
            r#"{"m": {"input_cost_per_token": 1e-06, "output_cost_per_token": 0}}"#,
        )
        .unwrap();
        std::fs::write(
            &new,
            r#"{"m": {"input_cost_per_token": 2e-06, "output_cost_per_token": 0}}"#,
        )
        .unwrap();
        let table = PriceTable::load(&format!(
            "2026-06-01={}, 2026-01-01={}",
            new.display(),
            old.display()
        ))
        .unwrap();
        let at = |day: &str| Usage {
            started_at_us: day_start_us(day).unwrap() + 1,
            ..usage("m", 1000, 0)
        };
        let before = table.cost(&at("2026-03-01")).unwrap();
        let after = table.cost(&at("2026-07-01")).unwrap();
        assert_eq!((before.micros, after.micros), (1000, 2000));
        assert!(
            before.version.starts_with("2026-01-01/"),
            "{}",
            before.version
        );
        assert!(
            after.version.starts_with("2026-06-01/"),
            "{}",
            after.version
        );
        // Before every version: no price.
        assert_eq!(table.cost(&at("2025-12-01")), None);
    }

    #[test]
    fn bad_price_files_are_refused_with_the_reason() {
        for (json, says) in [
            ("[]", "one JSON object"),
            ("{", "not JSON"),
            (
                r#"{"m": {"input_cost_per_token": "x", "output_cost_per_token": 0}}"#,
                "not a number",
            ),
            (
                r#"{"m": {"input_cost_per_token": -1, "output_cost_per_token": 0}}"#,
                "not a price",
            ),
            (r#"{"m": 3}"#, "not an object"),
        ] {
            let e = format!(
                "{:#}",
                PriceTable::from_json(None, json.as_bytes()).unwrap_err()
            );
            assert!(e.contains(says), "{json}: {e}");
        }
        assert!(PriceTable::from_json(Some("June"), b"{}").is_err());
        let e = PriceTable::load("/nonexistent/prices.json").unwrap_err();
        assert!(format!("{e:#}").contains("cannot read"), "{e:#}");
    }
}
