//! Test support shared by the suite's integration tests: services as OS processes, and an
//! OTLP receiver.

pub mod otlp;
pub mod processes;
