//! Object storage for images lives in the shared `ecoscan-objects` crate (analytics stores LLM
//! bodies through it too); re-exported here so ingest code names it as one of its stores. Image
//! keys are content-addressed, so a repeated upload is stored once.

pub use ecoscan_objects::{
    LocalObjectStore, ObjectError, ObjectStore, ObjectStoreConfig, S3Config,
};
