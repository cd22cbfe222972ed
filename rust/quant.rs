//! `quant` (being written).
