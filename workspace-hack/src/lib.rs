//! Nothing to use: this crate's dependencies give the workspace's binaries one set of features
//! for what they share, so that a dependency built for one is there for the others (see its
//! `Cargo.toml`).
