//! For a service's `build.rs`: embeds every `<version>_<description>.sql` file of a migrations
//! directory in the crate, for [`ecoscan_sql::embedded`] to turn into a migrator at run time.
//!
//! This does what sqlx's `migrate!` macro does, without the macro: `migrate!` needs sqlx's
//! `macros` feature, which compiles the database drivers (and SQLite's C code) a second time for
//! the build host, minutes of a cold build on two cores. A migration added to the directory is
//! picked up by the next build, as with the macro; nothing lists the files by hand.

use std::{fmt::Write as _, path::Path};

/// Writes `$OUT_DIR/migrations.rs`: a `&[(&str, &str)]` expression of (file name, contents)
/// for each `.sql` file of `dir` (relative to the crate), sorted by name, each through
/// `include_str!` so that its text is the file's, byte for byte (the checksum sqlx records is
/// of that text), by a path from `CARGO_MANIFEST_DIR`. Reruns the build script when the
/// directory changes.
///
/// # Panics
///
/// When the directory cannot be read or `OUT_DIR` is not set: a build script cannot go on.
pub fn embed_migrations(dir: &str) {
    println!("cargo:rerun-if-changed={dir}");
    let rel = dir;
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR is set");
    let dir = Path::new(&manifest).join(rel);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read the migrations in {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "sql"))
        .collect();
    files.sort();
    let mut out = String::from("&[\n");
    for path in &files {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .expect("migration file names are UTF-8");
        // Relative to the crate as it is compiled, not as this script found it: cargo shares
        // a build script's output between checkouts of the workspace in one target directory,
        // and an absolute path would point into whichever checkout ran the script.
        let _ = writeln!(
            out,
            "    ({name:?}, include_str!(concat!(env!(\"CARGO_MANIFEST_DIR\"), {:?}))),",
            format!("/{}/{name}", rel.trim_matches('/'))
        );
    }
    out.push(']');
    let out_dir = std::env::var("OUT_DIR").expect("OUT_DIR is set");
    std::fs::write(Path::new(&out_dir).join("migrations.rs"), out)
        .expect("writing the embedded migrations");
}
