//! `attention` (being written).
