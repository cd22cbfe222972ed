//! TODO(keys): filled in by the foundation work.
