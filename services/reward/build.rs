// `sqlx::migrate!` embeds `migrations/postgres/` at build time; a migration added there must
// rebuild the crate.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
