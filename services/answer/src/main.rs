//! `ecoscan-answer`: the answer service as its own process.

use ecoscan_common::binary;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    binary::command(
        "ecoscan-answer",
        "The answer service: writes disposal steps with the model, streamed",
        "ANSWER_ADDR",
        false,
    );
    let _guard = ecoscan_common::telemetry::init("answer")?;
    let config = ecoscan_answer::Config::from_env()?;
    let listener = binary::bind("answer", "ANSWER_ADDR", "127.0.0.1:50054").await?;
    ecoscan_answer::serve(config, listener, binary::shutdown_on_signal()).await
}
