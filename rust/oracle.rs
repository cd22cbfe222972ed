//! `oracle` (being written).
