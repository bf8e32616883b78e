// The test migrations, embedded as the services embed theirs (see `ecoscan_sql_build`).
fn main() {
    ecoscan_sql_build::embed_migrations("test-migrations");
}
