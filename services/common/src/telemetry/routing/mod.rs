//! Several services in one process (`ecoscan up`), each exporting under its own resource.
//!
//! A tracer provider carries one resource, so each service gets a provider of its own, and one
//! OpenTelemetry layer hands every span to the right one:
//!
//! - [`ServiceLayer`] decides which service a tracing span belongs to when it is created: the
//!   service its `ecoscan.service` field names, else its parent's (a model call inside vision's
//!   handler is vision's), else for a root span the service that owns its gRPC service
//!   (`rpc.service`, the server span every RPC opens) or its crate (`ecoscan_ingest::…`). It
//!   keeps the answer in the span's extensions, for the span's children.
//! - [`RoutingTracer`] is the tracer of the OpenTelemetry layer: it marks each new span builder
//!   with that service (an `ecoscan.service` attribute, taken off again before export) and
//!   builds the span with that service's tracer. Spans of no service go to the default one.
//!
//! The layer and the tracer meet in one call: the OpenTelemetry layer asks the tracer for a
//! builder right after [`ServiceLayer`] has seen the same new span on the same thread (the layer
//! is installed under the OpenTelemetry layer, so it runs first); a thread-local hands the
//! service over in between.

use std::{borrow::Cow, cell::Cell, collections::HashMap, fmt, sync::Arc};

use opentelemetry::{
    Context, Key, KeyValue, Value,
    trace::{SpanBuilder, Tracer},
};
use opentelemetry_sdk::trace::{SdkTracer, Span as SdkSpan};
use tracing::{
    Subscriber,
    field::{Field, Visit},
    span,
};
use tracing_subscriber::{Layer, layer::Context as LayerContext, registry::LookupSpan};

/// The span field (and, on the builder, the attribute) that names a span's service. A root span
/// that neither its crate nor its gRPC service attributes (one created in a shared crate for a
/// service, with no parent) sets it.
pub const SERVICE_FIELD: &str = "ecoscan.service";

/// Which spans belong to which service.
#[derive(Clone, Debug, Default)]
pub struct ServiceRoutes {
    /// By crate: the first segment of a span's target (`ecoscan_ingest`). A short list compared
    /// in order: every new span asks, and hashing its target cost more than comparing it.
    crates: Vec<(String, &'static str)>,
    /// By fully-qualified gRPC service (`ecoscan.v1.ScanService`).
    rpc: HashMap<String, &'static str>,
    names: Vec<&'static str>,
}

impl ServiceRoutes {
    /// Adds `service` (`ingest`, exported as `ecoscan-ingest`), owning the spans of the crates
    /// `crates` (`ecoscan_ingest`) and the server spans of the gRPC services `rpc`.
    pub fn service(mut self, service: &'static str, crates: &[&str], rpc: &[&str]) -> Self {
        self.names.push(service);
        for c in crates {
            self.crates.retain(|(k, _)| k != c);
            self.crates.push(((*c).to_owned(), service));
        }
        for r in rpc {
            self.rpc.insert((*r).to_owned(), service);
        }
        self
    }

    /// Every service, in the order added.
    pub fn services(&self) -> &[&'static str] {
        &self.names
    }

    fn by_name(&self, name: &str) -> Option<&'static str> {
        self.names.iter().copied().find(|n| *n == name)
    }

    fn by_target(&self, target: &str) -> Option<&'static str> {
        let krate = target.split("::").next().unwrap_or(target);
        self.crates
            .iter()
            .find(|(k, _)| k == krate)
            .map(|(_, service)| *service)
    }
}

/// The service a span belongs to, in its extensions.
#[derive(Clone, Copy, Debug)]
struct Owner(&'static str);

thread_local! {
    /// The service of the span being created on this thread, from [`ServiceLayer::on_new_span`]
    /// to [`RoutingTracer::span_builder`].
    static NEW_SPAN_SERVICE: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// Decides each span's service (see the module documentation). Install it unfiltered, under
/// the OpenTelemetry layer.
pub struct ServiceLayer {
    routes: Arc<ServiceRoutes>,
}

impl ServiceLayer {
    pub fn new(routes: Arc<ServiceRoutes>) -> Self {
        Self { routes }
    }
}

/// Reads the two fields that route a span.
#[derive(Default)]
struct RouteFields {
    service: Option<String>,
    rpc_service: Option<String>,
}

impl Visit for RouteFields {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            SERVICE_FIELD => self.service = Some(value.to_owned()),
            "rpc.service" => self.rpc_service = Some(value.to_owned()),
            _ => {}
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if matches!(field.name(), SERVICE_FIELD | "rpc.service") {
            // `%value` fields arrive here; Display and Debug agree for the strings we expect.
            self.record_str(field, format!("{value:?}").trim_matches('"'));
        }
    }
}

impl<S> Layer<S> for ServiceLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: LayerContext<'_, S>) {
        let mut fields = RouteFields::default();
        attrs.record(&mut fields);
        let parent = if let Some(parent) = attrs.parent() {
            ctx.span(parent)
        } else if attrs.is_contextual() {
            ctx.lookup_current()
        } else {
            None
        };
        let inherited = parent.and_then(|p| p.extensions().get::<Owner>().map(|o| o.0));
        let owner = fields
            .service
            .as_deref()
            .and_then(|s| self.routes.by_name(s))
            .or(inherited)
            .or_else(|| {
                fields
                    .rpc_service
                    .as_deref()
                    .and_then(|r| self.routes.rpc.get(r).copied())
            })
            .or_else(|| self.routes.by_target(attrs.metadata().target()));
        NEW_SPAN_SERVICE.with(|s| s.set(owner));
        if let (Some(owner), Some(span)) = (owner, ctx.span(id)) {
            span.extensions_mut().insert(Owner(owner));
        }
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, ctx: LayerContext<'_, S>) {
        let mut fields = RouteFields::default();
        values.record(&mut fields);
        if let Some(owner) = fields
            .service
            .as_deref()
            .and_then(|s| self.routes.by_name(s))
            && let Some(span) = ctx.span(id)
        {
            span.extensions_mut().replace(Owner(owner));
        }
    }
}

/// The service the current span belongs to, when [`ServiceLayer`] routes this process's spans
/// (`ecoscan up`); `None` in a process of one service. A span created away from its service's
/// spans (a background task's root span) records it as [`SERVICE_FIELD`].
pub fn current_service() -> Option<&'static str> {
    tracing::Span::current()
        .with_subscriber(|(id, dispatch)| {
            let registry = dispatch.downcast_ref::<tracing_subscriber::Registry>()?;
            let span = registry.span(id)?;
            span.extensions().get::<Owner>().map(|o| o.0)
        })
        .flatten()
}

/// The OpenTelemetry layer's tracer in a process of several services: builds each span with
/// the tracer of the service it belongs to.
#[derive(Clone, Debug)]
pub struct RoutingTracer {
    default: SdkTracer,
    by_service: Arc<HashMap<&'static str, SdkTracer>>,
}

impl RoutingTracer {
    /// `default` takes the spans of no service.
    pub fn new(default: SdkTracer, by_service: HashMap<&'static str, SdkTracer>) -> Self {
        Self {
            default,
            by_service: Arc::new(by_service),
        }
    }

    /// Takes the service mark off `builder` (the last one set wins: a recorded
    /// [`SERVICE_FIELD`] comes after the one set at creation).
    fn take_service(builder: &mut SpanBuilder) -> Option<String> {
        let attrs = builder.attributes.as_mut()?;
        let key = Key::from_static_str(SERVICE_FIELD);
        let service = attrs
            .iter()
            .rev()
            .find(|kv| kv.key == key)
            .map(|kv| match &kv.value {
                Value::String(s) => s.as_str().to_owned(),
                other => other.to_string(),
            });
        attrs.retain(|kv| kv.key != key);
        service
    }
}

impl Tracer for RoutingTracer {
    type Span = SdkSpan;

    fn span_builder<T>(&self, name: T) -> SpanBuilder
    where
        T: Into<Cow<'static, str>>,
    {
        let builder = SpanBuilder::from_name(name);
        match NEW_SPAN_SERVICE.with(Cell::take) {
            Some(service) => builder.with_attributes([KeyValue::new(SERVICE_FIELD, service)]),
            None => builder,
        }
    }

    fn build_with_context(&self, mut builder: SpanBuilder, parent_cx: &Context) -> Self::Span {
        let tracer = Self::take_service(&mut builder)
            .and_then(|s| self.by_service.get(s.as_str()))
            .unwrap_or(&self.default);
        tracer.build_with_context(builder, parent_cx)
    }
}

#[cfg(test)]
mod tests;
