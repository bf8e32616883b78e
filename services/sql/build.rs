// `sqlx::migrate!` embeds `test-migrations/` at build time (a test); a file added there must
// rebuild the crate.
fn main() {
    println!("cargo:rerun-if-changed=test-migrations");
}
