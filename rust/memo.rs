//! TODO(memo): filled in by the foundation work.
