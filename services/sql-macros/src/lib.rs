//! `#[db_span(...)]`: one definition of the span a store operation runs in, for every store
//! (SQL and Redis). Written out on each method instead, the same long
//! `#[tracing::instrument(...)]` attribute stood over every operation of every store, where one
//! of them could drift from the others (another field name, a span name not in the
//! conventions' form) unnoticed; traces, and the tests that look for these spans, rely on all
//! of them being alike.
//!
//! The macro only rewrites its own arguments into a `tracing::instrument` attribute and leaves
//! the method as it is, so it needs no parser crate (the build stays as fast as it was) and
//! works under `#[async_trait]` exactly as `tracing::instrument` does (the impl's attribute
//! expands first; the method's attributes then see the rewritten method).

use proc_macro::{Delimiter, TokenStream, TokenTree};

/// The span of one store operation: an OpenTelemetry database client span with the attributes
/// of the semantic conventions for database client spans.
///
/// ```ignore
/// #[db_span(system = DB::SYSTEM, op = "SELECT", collection = "scan_jobs", fields(job.id = %id))]
/// async fn get(&self, id: &str) -> Result<Option<JobRow>, StoreError> { … }
/// ```
///
/// becomes
///
/// ```text
/// #[tracing::instrument(
///     name = "db",
///     skip_all,
///     fields(otel.name = "SELECT scan_jobs", otel.kind = "client", db.system = DB::SYSTEM,
///            db.operation.name = "SELECT", db.collection.name = "scan_jobs",
///            otel.status_code = Empty, otel.status_description = Empty, error.type = Empty,
///            server.address = Empty, server.port = Empty, job.id = %id)
/// )]
/// ```
///
/// - `system` (any expression: `DB::SYSTEM` for a store generic over its dialect, `"redis"`)
///   and `op` are required; `collection` is left out where the store has keys, not
///   collections (Redis);
/// - the exported name (`otel.name`) is `"<op> <collection>"` as the conventions ask, or `op`
///   alone without a collection; `name = "…"` replaces it where that is not the operation's
///   name (a transaction over two tables, a script standing for a command);
/// - no argument is recorded (`skip_all`): they carry users' data; a span names what it
///   records in `fields(...)`, added after the conventional ones;
/// - an operation whose statement or command fails is marked failed by the store's connection
///   (`ecoscan_sql::Db`, `ecoscan_redis::Conn`) through `otel.status_code`,
///   `otel.status_description` and `error.type`, declared here. Not with `instrument`'s `err`:
///   that writes an `ERROR` line with an empty message for every failed call (`ERROR
///   ecoscan_ingest::store::redis: error=redis: timed out`), a flood during an outage that
///   the store's health already says once.
#[proc_macro_attribute]
pub fn db_span(attr: TokenStream, item: TokenStream) -> TokenStream {
    match Spec::parse(attr) {
        Ok(spec) => {
            let mut out: TokenStream = spec
                .attribute()
                .parse()
                .expect("a db_span attribute is valid Rust");
            out.extend(item);
            out
        }
        Err(message) => format!("::core::compile_error!({message:?});")
            .parse()
            .expect("a compile_error! call is valid Rust"),
    }
}

/// The arguments of one `#[db_span(...)]`, each as the source text it was written as.
struct Spec {
    system: String,
    op: String,
    collection: Option<String>,
    name: Option<String>,
    fields: Option<String>,
}

const USAGE: &str = "expected #[db_span(system = <expr>, op = \"…\", collection = \"…\", \
                     name = \"…\", fields(…))] with system and op required";

impl Spec {
    fn parse(attr: TokenStream) -> Result<Self, String> {
        let mut spec = Spec {
            system: String::new(),
            op: String::new(),
            collection: None,
            name: None,
            fields: None,
        };
        for arg in split_commas(attr) {
            let mut tokens = arg.into_iter();
            let key = match tokens.next() {
                Some(TokenTree::Ident(key)) => key.to_string(),
                _ => return Err(USAGE.into()),
            };
            let rest: Vec<TokenTree> = tokens.collect();
            if key == "fields" {
                match rest.as_slice() {
                    [TokenTree::Group(g)] if g.delimiter() == Delimiter::Parenthesis => {
                        spec.fields = Some(g.stream().to_string());
                        continue;
                    }
                    _ => return Err(USAGE.into()),
                }
            }
            let value = match rest.split_first() {
                Some((TokenTree::Punct(eq), value)) if eq.as_char() == '=' && !value.is_empty() => {
                    value.iter().cloned().collect::<TokenStream>().to_string()
                }
                _ => return Err(USAGE.into()),
            };
            let literal = || -> Result<String, String> {
                match value.starts_with('"') {
                    true => Ok(value.clone()),
                    false => Err(format!("db_span: `{key}` takes a string literal")),
                }
            };
            match key.as_str() {
                "system" => spec.system = value.clone(),
                "op" => spec.op = literal()?,
                "collection" => spec.collection = Some(literal()?),
                "name" => spec.name = Some(literal()?),
                other => return Err(format!("db_span: unknown argument `{other}`; {USAGE}")),
            }
        }
        if spec.system.is_empty() || spec.op.is_empty() {
            return Err(USAGE.into());
        }
        Ok(spec)
    }

    /// The `tracing::instrument` attribute this spec stands for.
    fn attribute(&self) -> String {
        let Spec {
            system,
            op,
            collection,
            name,
            fields,
        } = self;
        let otel_name = match (name, collection) {
            (Some(name), _) => name.clone(),
            (None, Some(collection)) => format!(
                "\"{} {}\"",
                op.trim_matches('"'),
                collection.trim_matches('"')
            ),
            (None, None) => op.clone(),
        };
        let collection = collection
            .as_ref()
            .map(|c| format!(", db.collection.name = {c}"))
            .unwrap_or_default();
        let fields = fields
            .as_ref()
            .map(|f| format!(", {f}"))
            .unwrap_or_default();
        format!(
            "#[::tracing::instrument(name = \"db\", skip_all, fields(otel.name = {otel_name}, \
             otel.kind = \"client\", db.system = {system}, db.system.name = {system}, db.operation.name = {op}\
             , db.query.summary = {otel_name}{collection}, otel.status_code = ::tracing::field::Empty, \
             otel.status_description = ::tracing::field::Empty, \
             error.type = ::tracing::field::Empty, server.address = ::tracing::field::Empty, \
             server.port = ::tracing::field::Empty{fields}))]"
        )
    }
}

/// The attribute's arguments, split at its top-level commas.
fn split_commas(attr: TokenStream) -> Vec<Vec<TokenTree>> {
    let mut args = vec![Vec::new()];
    for token in attr {
        match &token {
            TokenTree::Punct(p) if p.as_char() == ',' => args.push(Vec::new()),
            _ => args.last_mut().expect("never empty").push(token),
        }
    }
    args.retain(|a| !a.is_empty());
    args
}
