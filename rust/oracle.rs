//! TODO(oracle): filled in by the foundation work.
