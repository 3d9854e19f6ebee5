//! The model runner: configuration first (the forward, MTP head, caches and speculative loop
//! come with the model-runner issue).

pub mod config;
pub mod weights;
