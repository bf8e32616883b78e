//! Test helpers: a private PostgreSQL schema per test (shared with every SQL store), and
//! what this crate's tests need besides.

pub use ecoscan_sql::testing::PgSchema;
