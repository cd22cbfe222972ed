//! Bindings of constrained decoding: a model's grammar vocabulary, compiled grammars, and a
//! sequence's grammar state (what a mesh's exit station keeps per session).

use std::sync::Arc;

use pyo3::prelude::*;

use crate::grammar::{
    Grammar, GrammarKind, GrammarSpec, GrammarState, Vocabulary, MAX_GRAMMAR_BYTES,
};

/// A model's vocabulary for grammars: token `i`'s bytes are `tokens[i]` (a special token's
/// are `b"\xff"` + its name, so no text matches it), and `eos` are the tokens that end a
/// sequence (allowed only where a grammar accepts). Built once per model: it indexes every
/// token (~0.2 s for 49k tokens, ~2 s for 262k; the GIL is released meanwhile).
#[pyclass(name = "GrammarVocabulary", module = "amplituhedron_rs._core", frozen)]
pub struct PyVocabulary {
    pub(crate) inner: Arc<Vocabulary>,
}

#[pymethods]
impl PyVocabulary {
    #[new]
    fn new(py: Python<'_>, tokens: Vec<Vec<u8>>, eos: Vec<u32>) -> PyResult<Self> {
        let inner = py.detach(|| Vocabulary::new(tokens, &eos))?;
        Ok(PyVocabulary {
            inner: Arc::new(inner),
        })
    }

    /// Tokens in the vocabulary.
    #[getter]
    fn size(&self) -> usize {
        self.inner.size()
    }

    /// The end-of-sequence tokens.
    #[getter]
    fn eos(&self) -> Vec<u32> {
        self.inner.eos().to_vec()
    }
}

/// A grammar compiled against a vocabulary: `kind` is "json_schema" (`text`: the schema's
/// JSON), "json_object" (any JSON object; `text` is ignored), "regex" (Rust `regex` syntax,
/// the whole output matches) or "lark" (llguidance's Lark syntax). Raises InputError with
/// llguidance's reason when it cannot be compiled or is longer than `MAX_GRAMMAR_BYTES`.
/// Compiling releases the GIL. JSON is written compactly (", " and ": " between items) unless
/// the schema's own `x-guidance` object says otherwise.
#[pyclass(name = "Grammar", module = "amplituhedron_rs._core", frozen)]
pub struct PyGrammar {
    pub(crate) inner: Grammar,
}

#[pymethods]
impl PyGrammar {
    #[new]
    fn new(py: Python<'_>, vocabulary: &PyVocabulary, kind: &str, text: String) -> PyResult<Self> {
        let spec = GrammarSpec {
            kind: GrammarKind::parse(kind)?,
            text,
        };
        let vocab = Arc::clone(&vocabulary.inner);
        let inner = py.detach(|| vocab.compile(spec))?;
        Ok(PyGrammar { inner })
    }

    /// How `text` is written.
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.spec().kind.as_str()
    }

    /// The schema, regex or grammar as given.
    #[getter]
    fn text(&self) -> &str {
        &self.inner.spec().text
    }

    /// A fresh state of this grammar (no token consumed).
    fn start(&self) -> PyGrammarState {
        PyGrammarState {
            inner: self.inner.start(),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "Grammar(kind={:?}, {} bytes)",
            self.kind(),
            self.inner.spec().text.len()
        )
    }
}

/// One sequence's position in its grammar. `Sampler.sample` and `Sampler.verify` take it to
/// sample under its mask and advance it by what they emit.
#[pyclass(name = "GrammarState", module = "amplituhedron_rs._core")]
pub struct PyGrammarState {
    pub(crate) inner: GrammarState,
}

#[pymethods]
impl PyGrammarState {
    /// Tokens consumed so far.
    #[getter]
    fn consumed(&self) -> usize {
        self.inner.consumed()
    }

    /// Whether the grammar is complete (it admits no further token): the sequence ends.
    #[getter]
    fn done(&self) -> bool {
        self.inner.is_done()
    }

    /// The ids allowed next (a grammar that is not done allows at least one).
    fn allowed(&mut self) -> PyResult<Vec<u32>> {
        Ok(self.inner.allowed()?.to_list())
    }

    /// Consumes `token` (it must be allowed).
    fn advance(&mut self, token: u32) -> PyResult<()> {
        Ok(self.inner.advance(token)?)
    }

    /// Brings the state to `consumed` tokens before a step: rolls back what it consumed
    /// beyond them (a retried step), or consumes `next` — the step's first token — when it is
    /// exactly one short (a session rebuilt elsewhere). Raises InputError otherwise.
    fn align(&mut self, consumed: usize, next: u32) -> PyResult<()> {
        Ok(self.inner.align(consumed, next)?)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyVocabulary>()?;
    m.add_class::<PyGrammar>()?;
    m.add_class::<PyGrammarState>()?;
    m.add("MAX_GRAMMAR_BYTES", MAX_GRAMMAR_BYTES)?;
    Ok(())
}
