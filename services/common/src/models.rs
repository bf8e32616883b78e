//! The models a deployment offers its callers, one chosen per scan (`LLM_MODELS`).
//!
//! Ingest checks a scan's `model` against this list when the scan is submitted (so a bad choice
//! is refused before anything runs), and vision and answer check it again before they call the
//! model (their RPCs are callable on their own). All three read the same setting; a deployment
//! sets it once for all of them.

use std::fmt;

use anyhow::anyhow;

use crate::config::env_opt;

/// The setting: `name[=system]` entries separated by commas, e.g.
/// `gpt-4o-mini=openai,gemini-2.0-flash=gemini`. `system` is the model's vendor as
/// OpenTelemetry's `gen_ai.system` names it (what traces, metrics and analytics report); the
/// provider's own name (`openai` for the OpenAI-compatible endpoint) when left out. Every model
/// is asked through the one configured endpoint (`LLM_BASE_URL`): a router such as LiteLLM
/// serves models of several vendors behind one.
pub const MODELS_VAR: &str = "LLM_MODELS";

/// The longest model name taken, in bytes.
pub const MAX_MODEL_NAME: usize = 128;

/// One offered model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OfferedModel {
    /// The name callers choose and the provider is asked for.
    pub name: String,
    /// Its vendor (`gen_ai.system`), when the setting names one.
    pub system: Option<String>,
}

/// The models callers may choose from; empty when the deployment offers no choice (every scan
/// then uses the models configured per stage).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OfferedModels {
    models: Vec<OfferedModel>,
}

impl OfferedModels {
    /// Reads [`MODELS_VAR`]; unset or empty offers no choice.
    pub fn from_env() -> anyhow::Result<Self> {
        match env_opt(MODELS_VAR) {
            None => Ok(Self::default()),
            Some(v) => Self::parse(&v).map_err(|e| anyhow!("invalid {MODELS_VAR} {v:?}: {e}")),
        }
    }

    /// Parses the setting's value (see [`MODELS_VAR`]).
    pub fn parse(value: &str) -> anyhow::Result<Self> {
        let mut models: Vec<OfferedModel> = Vec::new();
        for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (name, system) = match entry.split_once('=') {
                Some((name, system)) => (name.trim(), Some(system.trim())),
                None => (entry, None),
            };
            check_name(name).map_err(|e| anyhow!("model {name:?}: {e}"))?;
            if let Some(system) = system
                && (system.is_empty()
                    || !system
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)))
            {
                return Err(anyhow!(
                    "model {name:?}: its vendor {system:?} must be a name such as openai or \
                     gemini (letters, digits, '.', '_' or '-')"
                ));
            }
            if models.iter().any(|m| m.name == name) {
                return Err(anyhow!("model {name:?} is listed twice"));
            }
            models.push(OfferedModel {
                name: name.to_owned(),
                system: system.map(str::to_owned),
            });
        }
        Ok(Self { models })
    }

    /// True when callers have no choice of model.
    pub fn is_empty(&self) -> bool {
        self.models.is_empty()
    }

    /// The offered names, in the setting's order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.models.iter().map(|m| m.name.as_str())
    }

    /// A caller's choice: `Ok(None)` when it names none (the stage's configured model is
    /// used), the offered model it names, or why it cannot be used.
    pub fn choose(&self, requested: &str) -> Result<Option<&OfferedModel>, ModelRefused> {
        if requested.is_empty() {
            return Ok(None);
        }
        self.models
            .iter()
            .find(|m| m.name == requested)
            .map(Some)
            .ok_or_else(|| ModelRefused {
                requested: shorten(requested),
                offered: self.names().map(str::to_owned).collect(),
            })
    }
}

/// A model name a caller may not choose.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelRefused {
    /// What was asked for (cut short when long).
    pub requested: String,
    /// What may be asked for instead; empty when the deployment offers no choice.
    pub offered: Vec<String>,
}

impl fmt::Display for ModelRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.offered.is_empty() {
            write!(
                f,
                "model {:?} cannot be chosen: this deployment offers no choice of model \
                 ({MODELS_VAR} is unset); leave model empty for the configured one",
                self.requested
            )
        } else {
            write!(
                f,
                "model {:?} is not offered; choose one of: {} (or leave model empty for the \
                 default)",
                self.requested,
                self.offered.join(", ")
            )
        }
    }
}

impl std::error::Error for ModelRefused {}

fn check_name(name: &str) -> anyhow::Result<()> {
    if name.is_empty() {
        return Err(anyhow!("an entry names no model"));
    }
    if name.len() > MAX_MODEL_NAME {
        return Err(anyhow!("longer than {MAX_MODEL_NAME} bytes"));
    }
    // Printable ASCII without separators: names such as `gemini/gemini-2.0-flash` or
    // `llama3.1:8b` pass; white space, quotes and control characters do not.
    if !name
        .bytes()
        .all(|b| b.is_ascii_graphic() && !b"\"'\\,=".contains(&b))
    {
        return Err(anyhow!(
            "only printable ASCII without spaces, quotes, ',' or '=' may name a model"
        ));
    }
    Ok(())
}

/// A requested name as an error message repeats it: at most [`MAX_MODEL_NAME`] characters.
fn shorten(requested: &str) -> String {
    match requested.char_indices().nth(MAX_MODEL_NAME) {
        Some((end, _)) => format!("{}…", &requested[..end]),
        None => requested.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_name_a_model_and_optionally_its_vendor() {
        let offered = OfferedModels::parse(
            " gpt-4o-mini=openai , gemini/gemini-2.0-flash=gemini,llama3.1:8b",
        )
        .unwrap();
        assert_eq!(
            offered.names().collect::<Vec<_>>(),
            ["gpt-4o-mini", "gemini/gemini-2.0-flash", "llama3.1:8b"]
        );
        let gemini = offered.choose("gemini/gemini-2.0-flash").unwrap().unwrap();
        assert_eq!(gemini.system.as_deref(), Some("gemini"));
        assert_eq!(offered.choose("llama3.1:8b").unwrap().unwrap().system, None);
        assert_eq!(offered.choose("").unwrap(), None);
        assert!(OfferedModels::parse("").unwrap().is_empty());
    }

    #[test]
    fn bad_entries_are_refused_with_the_reason() {
        for (value, says) in [
            ("a,a", "listed twice"),
            ("=openai", "names no model"),
            ("gpt 4", "printable ASCII"),
            ("gpt-4=", "vendor"),
            ("gpt-4=open ai", "vendor"),
        ] {
            let e = OfferedModels::parse(value).unwrap_err().to_string();
            assert!(e.contains(says), "{value:?}: {e}");
        }
        let long = "m".repeat(MAX_MODEL_NAME + 1);
        assert!(OfferedModels::parse(&long).is_err());
    }

    #[test]
    fn a_refused_choice_names_the_offered_models() {
        let offered = OfferedModels::parse("gpt-4o-mini,gpt-4o").unwrap();
        let e = offered.choose("gpt-5").unwrap_err();
        assert_eq!(e.offered, ["gpt-4o-mini", "gpt-4o"]);
        assert!(
            e.to_string().contains("choose one of: gpt-4o-mini, gpt-4o"),
            "{e}"
        );

        let none = OfferedModels::default().choose("gpt-4o").unwrap_err();
        assert!(none.to_string().contains("offers no choice"), "{none}");

        // A huge name is not echoed back whole.
        let e = offered.choose(&"x".repeat(10_000)).unwrap_err();
        assert!(e.to_string().len() < 400);
    }
}
