//! `ring` (being written).
