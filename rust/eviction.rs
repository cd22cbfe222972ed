//! `eviction` (being written).
