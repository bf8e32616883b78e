//! Schemas of the `ecoscan.v1` messages the gateway answers with as proto3 JSON, read from the
//! descriptor set compiled into `ecoscan-proto` (comments included), so the document follows the
//! protos without a copy of them.
//!
//! The JSON is pbjson's, as `ecoscan-proto` configures it: proto field names, every field
//! emitted (scalars and lists at their defaults too, message fields only when set), 64-bit
//! integers as decimal strings, enums as their names, bytes as base64, `Timestamp` as RFC 3339.

use std::{
    borrow::Cow,
    collections::{BTreeMap, HashMap},
    sync::LazyLock,
};

use prost::Message as _;
use prost_types::{
    DescriptorProto, EnumDescriptorProto, FieldDescriptorProto, FileDescriptorSet,
    field_descriptor_proto::{Label, Type as ProtoType},
};
use utoipa::{
    PartialSchema, ToSchema,
    openapi::{
        Ref, RefOr,
        schema::{
            AdditionalProperties, ArrayBuilder, KnownFormat, ObjectBuilder, Schema, SchemaFormat,
            Type,
        },
    },
};

/// The package the REST API passes messages of.
const PACKAGE: &str = ".ecoscan.v1.";

struct Message {
    descriptor: DescriptorProto,
    description: Option<String>,
    /// Each field's description, by field index.
    fields: Vec<Option<String>>,
}

#[derive(Default)]
struct Index {
    messages: HashMap<String, Message>,
    enums: HashMap<String, EnumDescriptorProto>,
}

static INDEX: LazyLock<Index> = LazyLock::new(Index::load);

/// A comment as a one-paragraph description.
fn clean(comment: &str) -> String {
    comment
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

impl Index {
    fn load() -> Self {
        let set = FileDescriptorSet::decode(ecoscan_proto::FILE_DESCRIPTOR_SET)
            .expect("the descriptor set compiled into ecoscan-proto decodes");
        let mut index = Self::default();
        for file in &set.file {
            let comments: HashMap<Vec<i32>, String> = file
                .source_code_info
                .iter()
                .flat_map(|info| &info.location)
                .filter_map(|l| Some((l.path.clone(), clean(l.leading_comments.as_ref()?))))
                .collect();
            let scope = format!(".{}", file.package());
            for (i, m) in file.message_type.iter().enumerate() {
                index.add_message(&scope, m, vec![4, i as i32], &comments);
            }
            for e in &file.enum_type {
                index
                    .enums
                    .insert(format!("{scope}.{}", e.name()), e.clone());
            }
        }
        index
    }

    fn add_message(
        &mut self,
        scope: &str,
        m: &DescriptorProto,
        path: Vec<i32>,
        comments: &HashMap<Vec<i32>, String>,
    ) {
        let full = format!("{scope}.{}", m.name());
        for (k, nested) in m.nested_type.iter().enumerate() {
            let mut p = path.clone();
            p.extend([3, k as i32]);
            self.add_message(&full, nested, p, comments);
        }
        for e in &m.enum_type {
            self.enums.insert(format!("{full}.{}", e.name()), e.clone());
        }
        let fields = (0..m.field.len())
            .map(|j| {
                let mut p = path.clone();
                p.extend([2, j as i32]);
                comments.get(&p).cloned()
            })
            .collect();
        self.messages.insert(
            full,
            Message {
                descriptor: m.clone(),
                description: comments.get(&path).cloned(),
                fields,
            },
        );
    }

    /// The schema of message `name` (without package), and the messages it refers to.
    fn schema(&self, name: &str) -> (Schema, Vec<String>) {
        let full = format!("{PACKAGE}{name}");
        let msg = self
            .messages
            .get(&full)
            .unwrap_or_else(|| panic!("no message {full} in the descriptor set"));
        let mut deps = Vec::new();
        let mut object = ObjectBuilder::new()
            .schema_type(Type::Object)
            .description(msg.description.clone());
        for (field, description) in msg.descriptor.field.iter().zip(&msg.fields) {
            let schema = self.field(field, description.clone(), &mut deps);
            object = object.property(field.name(), schema);
            if always_emitted(field) {
                object = object.required(field.name());
            }
        }
        (object.build().into(), deps)
    }

    fn field(
        &self,
        field: &FieldDescriptorProto,
        description: Option<String>,
        deps: &mut Vec<String>,
    ) -> RefOr<Schema> {
        if field.label() == Label::Repeated {
            if let Some(entry) = self.map_entry(field) {
                let value = &entry.field[1];
                let values = self.single(value, None, deps);
                return ObjectBuilder::new()
                    .schema_type(Type::Object)
                    .additional_properties(Some(AdditionalProperties::RefOr(values)))
                    .description(description)
                    .into();
            }
            let items = self.single(field, None, deps);
            return ArrayBuilder::new()
                .items(items)
                .description(description)
                .into();
        }
        self.single(field, description, deps)
    }

    fn map_entry(&self, field: &FieldDescriptorProto) -> Option<&DescriptorProto> {
        if field.r#type() != ProtoType::Message {
            return None;
        }
        let entry = &self.messages.get(field.type_name())?.descriptor;
        entry
            .options
            .as_ref()
            .is_some_and(|o| o.map_entry())
            .then_some(entry)
    }

    /// One value of `field`, as pbjson writes it.
    fn single(
        &self,
        field: &FieldDescriptorProto,
        description: Option<String>,
        deps: &mut Vec<String>,
    ) -> RefOr<Schema> {
        let object = |t: Type| ObjectBuilder::new().schema_type(t);
        let builder = match field.r#type() {
            ProtoType::Double | ProtoType::Float => object(Type::Number),
            ProtoType::Int32 | ProtoType::Sint32 | ProtoType::Sfixed32 => {
                object(Type::Integer).format(Some(SchemaFormat::KnownFormat(KnownFormat::Int32)))
            }
            ProtoType::Uint32 | ProtoType::Fixed32 => object(Type::Integer)
                .minimum(Some(0))
                .maximum(Some(u32::MAX)),
            // 64-bit integers are decimal strings in proto3 JSON.
            ProtoType::Int64 | ProtoType::Sint64 | ProtoType::Sfixed64 => {
                object(Type::String).pattern(Some("^-?[0-9]+$"))
            }
            ProtoType::Uint64 | ProtoType::Fixed64 => {
                object(Type::String).pattern(Some("^[0-9]+$"))
            }
            ProtoType::Bool => object(Type::Boolean),
            ProtoType::String => object(Type::String),
            ProtoType::Bytes => object(Type::String).content_encoding("base64"),
            ProtoType::Enum => {
                let names: Vec<String> = self
                    .enums
                    .get(field.type_name())
                    .map(|e| e.value.iter().map(|v| v.name().to_owned()).collect())
                    .unwrap_or_default();
                object(Type::String).enum_values(Some(names))
            }
            ProtoType::Message | ProtoType::Group => match field.type_name() {
                ".google.protobuf.Timestamp" => object(Type::String)
                    .format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime))),
                name => {
                    let short = name.strip_prefix(PACKAGE).unwrap_or(name).to_owned();
                    deps.push(short.clone());
                    let mut r = Ref::from_schema_name(short);
                    r.description = description.unwrap_or_default();
                    return r.into();
                }
            },
        };
        builder.description(description).into()
    }

    /// `(name, schema)` of every message `roots` refer to, directly or not, roots excluded.
    fn dependencies(&self, roots: &[String], out: &mut Vec<(String, RefOr<Schema>)>) {
        let mut seen: BTreeMap<String, ()> = roots.iter().map(|r| (r.clone(), ())).collect();
        let mut todo: Vec<String> = Vec::new();
        for root in roots {
            if self.messages.contains_key(&format!("{PACKAGE}{root}")) {
                todo.extend(self.schema(root).1);
            }
        }
        while let Some(name) = todo.pop() {
            if seen.insert(name.clone(), ()).is_some() {
                continue;
            }
            let (schema, deps) = self.schema(&name);
            out.push((name, schema.into()));
            todo.extend(deps);
        }
    }
}

/// Whether pbjson always writes `field` (it does, with `emit_fields`, unless the field is a
/// message, part of a `oneof` or `optional`).
fn always_emitted(field: &FieldDescriptorProto) -> bool {
    field.label() == Label::Repeated
        || (field.r#type() != ProtoType::Message
            && field.oneof_index.is_none()
            && !field.proto3_optional())
}

/// The schema of message `name` of `ecoscan.v1`, for the patches the gateway makes.
pub(super) fn message(name: &str) -> Schema {
    INDEX.schema(name).0
}

/// What `name`'s schema refers to, for [`ToSchema::schemas`].
pub(super) fn dependencies(name: &str, out: &mut Vec<(String, RefOr<Schema>)>) {
    INDEX.dependencies(&[name.to_owned()], out);
}

macro_rules! messages {
    ($($name:ident),* $(,)?) => {$(
        #[doc = concat!("The proto3 JSON of `ecoscan.v1.", stringify!($name), "`.")]
        pub(crate) struct $name;

        impl PartialSchema for $name {
            fn schema() -> RefOr<Schema> {
                message(stringify!($name)).into()
            }
        }

        impl ToSchema for $name {
            fn name() -> Cow<'static, str> {
                Cow::Borrowed(stringify!($name))
            }

            fn schemas(out: &mut Vec<(String, RefOr<Schema>)>) {
                dependencies(stringify!($name), out);
            }
        }
    )*};
}

messages!(
    Classification,
    DisposalRules,
    Answer,
    RewardDecision,
    Notification,
    ListOwnedResponse,
    ListCatalogueResponse,
    GetCharacterResponse,
    ListCategoriesResponse,
    ListResponse,
    UsageResponse,
);

/// Schema references for fields whose types the document describes from the protos (the
/// `schema_with` of the SSE payload's fields).
pub(crate) mod refs {
    use utoipa::{ToSchema, openapi::Ref};

    use super::{Answer, Classification, DisposalRules, RewardDecision};

    pub(crate) fn classification() -> Ref {
        Ref::from_schema_name(Classification::name())
    }

    pub(crate) fn disposal_rules() -> Ref {
        Ref::from_schema_name(DisposalRules::name())
    }

    pub(crate) fn answer() -> Ref {
        Ref::from_schema_name(Answer::name())
    }

    pub(crate) fn reward_decision() -> Ref {
        Ref::from_schema_name(RewardDecision::name())
    }
}

/// Every proto message schema the document needs beside those the handlers' bodies bring.
pub(crate) fn components() -> BTreeMap<String, RefOr<Schema>> {
    let mut out = Vec::new();
    for (name, schema) in [
        (Classification::name(), Classification::schema()),
        (DisposalRules::name(), DisposalRules::schema()),
        (Answer::name(), Answer::schema()),
        (RewardDecision::name(), RewardDecision::schema()),
        (Notification::name(), Notification::schema()),
    ] {
        dependencies(&name, &mut out);
        out.push((name.into_owned(), schema));
    }
    out.into_iter().collect()
}
