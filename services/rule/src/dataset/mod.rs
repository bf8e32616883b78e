//! The disposal-rule dataset: its JSON schema, validation at load time, and lookup of one
//! taxonomy path (major → middle → item) into localized rules.
//!
//! The embedded dataset (`data/rules.json`) is ecoscan's own Korean and English wording of the
//! Korean Ministry of Environment separate-collection guidelines, organised by the Eco² taxonomy.
//!
//! The pieces: `model` is the schema and the [`Dataset`] holding it, `load` parses and validates
//! it, `lookup` resolves a path into [`Rules`], and `names` is how names match for both.

mod load;
mod lookup;
mod model;
mod names;

#[cfg(test)]
mod tests;

pub use lookup::{Resolved, Rules};
pub use model::{Dataset, Locale};
