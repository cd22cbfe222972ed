//! `memo` (being written).
