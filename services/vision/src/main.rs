//! `ecoscan-vision`: the vision service as its own process.

ecoscan_common::service_main!(
    ecoscan_vision,
    "vision",
    "The vision service: classifies a photo of waste with the model",
    "VISION_ADDR",
    "127.0.0.1:50052"
);
