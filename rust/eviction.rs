//! TODO(eviction): filled in by the foundation work.
