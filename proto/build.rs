//! Compiles `ecoscan/v1/*.proto` with protox (no `protoc` binary needed), generates the tonic
//! clients and servers, the proto3-JSON serde impls, and writes the descriptor set that server
//! reflection serves.

use std::{env, fs, path::PathBuf};

use prost::Message;

const PROTOS: &[&str] = &[
    "ecoscan/v1/common.proto",
    "ecoscan/v1/vision.proto",
    "ecoscan/v1/rule.proto",
    "ecoscan/v1/answer.proto",
    "ecoscan/v1/reward.proto",
    "ecoscan/v1/analytics.proto",
    "ecoscan/v1/notification.proto",
    "ecoscan/v1/ingest.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(env::var("OUT_DIR")?);
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }

    let fds = protox::compile(PROTOS, ["."])?;
    let bytes = fds.encode_to_vec();
    fs::write(out.join("ecoscan_descriptor.bin"), &bytes)?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Well-known types come from pbjson-types so that they serialize as proto3 JSON
        // (a Timestamp becomes an RFC 3339 string).
        .compile_well_known_types(true)
        .extern_path(".google.protobuf", "::pbjson_types")
        .compile_fds(fds)?;

    pbjson_build::Builder::new()
        .register_descriptors(&bytes)?
        // REST clients see the same snake_case names as the protos and the gateway's own JSON.
        .preserve_proto_field_names()
        // Emit fields at their default values too (`"newly_granted": false`), so REST clients
        // never have to know proto3's omission rules.
        .emit_fields()
        .build(&[".ecoscan"])?;
    Ok(())
}
