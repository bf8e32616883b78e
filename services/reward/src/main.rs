//! The reward service as its own process. `ecoscan-reward migrate` applies the database
//! migrations and exits.

ecoscan_common::service_main!(
    ecoscan_reward,
    "reward",
    "The reward service: grants collectible characters",
    "REWARD_ADDR",
    "127.0.0.1:50055",
    migrations
);
