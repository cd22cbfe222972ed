//! `volume` (being written).
