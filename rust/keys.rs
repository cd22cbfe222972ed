//! `keys` (being written).
