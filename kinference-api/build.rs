//! Compiles the agent <-> gateway protobuf API with a vendored `protoc`, so no system package is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // prost-build reads PROTOC from the environment; build scripts are single-threaded, so setting it is sound.
    unsafe { std::env::set_var("PROTOC", protoc) };
    tonic_prost_build::configure()
        .compile_protos(&["proto/kinference/v1/agent.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
