//! `ecoscan-answer`: the answer service as its own process.

ecoscan_common::service_main!(
    ecoscan_answer,
    "answer",
    "The answer service: writes disposal steps with the model, streamed",
    "ANSWER_ADDR",
    "127.0.0.1:50054"
);
