//! `model` (being written).
