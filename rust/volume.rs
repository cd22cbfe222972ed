//! TODO(volume): filled in by the foundation work.
