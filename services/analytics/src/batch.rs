//! The batch the writer forms and the spool keeps: both use it, so it lives in a module that
//! imports neither.

use bytes::Bytes;

use crate::store::CallRow;

/// A batch as it is written: its rows (body locations filled in) and the one object holding
/// their bodies under `key` (empty when no call had a body).
#[derive(Debug, Clone)]
pub struct Batch {
    pub key: String,
    pub object: Bytes,
    pub rows: Vec<CallRow>,
}
