//! `ecoscan-rule`: serves the disposal-rule dataset over gRPC.

ecoscan_common::service_main!(
    ecoscan_rule,
    "rule",
    "The rule service: the disposal rules of a waste category",
    "RULE_ADDR",
    "127.0.0.1:50053"
);
