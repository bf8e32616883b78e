//! Test support shared by the suite's integration tests: services as OS processes, an OTLP
//! receiver, `ecoscan up` as one process, and the production stores (a schema, prefix and bucket per test; a private Redis).

pub mod otlp;
pub mod processes;
pub mod stores;
pub mod up;
