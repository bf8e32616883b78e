// The PostgreSQL migrations, embedded in the crate (see `ecoscan_sql_build`); a file added to
// `migrations/postgres/` is picked up by the next build.
fn main() {
    ecoscan_sql_build::embed_migrations("migrations/postgres");
}
