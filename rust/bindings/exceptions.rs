//! The exception hierarchy of the Python API, and the one place where every core error
//! becomes one of its classes.
//!
//! ```text
//! AmplituhedronError(Exception)
//! ├── InputError(AmplituhedronError, ValueError)  the arguments alone are wrong
//! ├── CacheError                                  the volume cache refused or failed
//! ├── RingError                                   a KV ring refused, given its state
//! ├── ModelError                                  the model cannot be loaded or run
//! ├── MeshError                                   stations unreachable or inconsistent
//! └── QueueFullError(AmplituhedronError, RuntimeError)  the engine's queue is full
//! ```
//!
//! The rule: `InputError` when the call would fail whatever state the object is in (a bad
//! shape, length, dtype, value or setting); the part's own class when valid arguments meet
//! a state that refuses them (rolling back past the journal, reading an overwritten
//! position, a cache refusing what the pipeline gathered). `InputError` also subclasses
//! `ValueError`, so code written against the earlier `ValueError`s keeps working. The
//! classes are created in the `amplituhedron_rs` namespace, where the package re-exports
//! them; Python code raises `MeshError` itself.

use pyo3::exceptions::{PyException, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

use crate::attention::AttnError;
use crate::engine::EngineError;
use crate::eviction::UnknownPolicyError;
use crate::grammar::GrammarError;
use crate::memo::MemoError;
use crate::model::{ModelError as CoreModelError, SamplingError};
use crate::oracle::OracleError;
use crate::quant::QuantError;
use crate::ring::RingError as CoreRingError;
use crate::volume::VolumeError;

pyo3::create_exception!(
    amplituhedron_rs,
    AmplituhedronError,
    PyException,
    "Base class of every error amplituhedron-rs raises."
);
pyo3::create_exception!(
    amplituhedron_rs,
    CacheError,
    AmplituhedronError,
    "The volume cache refused an operation on what the pipeline gathered, or failed."
);
pyo3::create_exception!(
    amplituhedron_rs,
    RingError,
    AmplituhedronError,
    "A session's KV ring refused the operation in its current state (rollback beyond its \
     journal or the current clock, recall full, a position not or no longer held…)."
);
pyo3::create_exception!(
    amplituhedron_rs,
    ModelError,
    AmplituhedronError,
    "The model cannot be loaded (an unreadable file, a bad config or bad tensors) or a run of \
     it failed."
);
pyo3::create_exception!(
    amplituhedron_rs,
    MeshError,
    AmplituhedronError,
    "A mesh that cannot be used: a bad mesh file, or stations unreachable, failing or \
     inconsistent."
);

/// The class object of an exception with two bases, `AmplituhedronError` and a builtin
/// (which `create_exception!` cannot express), made by calling `type`.
fn two_based(
    py: Python<'_>,
    name: &str,
    builtin: Bound<'_, PyType>,
    doc: &str,
) -> PyResult<Py<PyType>> {
    let bases = (py.get_type::<AmplituhedronError>(), builtin);
    let namespace = PyDict::new(py);
    namespace.set_item("__module__", "amplituhedron_rs")?;
    namespace.set_item("__doc__", doc)?;
    let class = py.get_type::<PyType>().call1((name, bases, namespace))?;
    Ok(class.cast_into::<PyType>()?.unbind())
}

/// An exception class that is also a builtin one (`InputError` is a `ValueError`).
macro_rules! two_based_exception {
    ($name:ident, $builtin:ty, $doc:expr) => {
        #[doc = $doc]
        pub struct $name;

        impl $name {
            /// The class object (created once).
            pub fn type_object(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
                static TYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
                TYPE.get_or_try_init(py, || {
                    two_based(py, stringify!($name), py.get_type::<$builtin>(), $doc)
                })
                .map(|class| class.bind(py))
            }

            /// An exception of this class carrying `message`.
            pub fn new_err(message: impl Into<String>) -> PyErr {
                let message = message.into();
                Python::attach(|py| match Self::type_object(py) {
                    Ok(class) => PyErr::from_type(class.clone(), message),
                    Err(e) => e,
                })
            }
        }
    };
}

two_based_exception!(
    InputError,
    PyValueError,
    "The arguments are wrong whatever the state: a bad shape, length, dtype, value or \
     setting. Also a ValueError."
);
two_based_exception!(
    QueueFullError,
    PyRuntimeError,
    "The engine's waiting queue is full: nothing was queued; retry later. Also a \
     RuntimeError."
);

/// Adds every class to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("AmplituhedronError", py.get_type::<AmplituhedronError>())?;
    m.add("InputError", InputError::type_object(py)?)?;
    m.add("QueueFullError", QueueFullError::type_object(py)?)?;
    m.add("CacheError", py.get_type::<CacheError>())?;
    m.add("RingError", py.get_type::<RingError>())?;
    m.add("ModelError", py.get_type::<ModelError>())?;
    m.add("MeshError", py.get_type::<MeshError>())?;
    Ok(())
}

// ----- the mapping ---------------------------------------------------------------------

impl From<CoreModelError> for PyErr {
    fn from(e: CoreModelError) -> PyErr {
        let message = e.to_string();
        match e {
            CoreModelError::Input(_) | CoreModelError::Sampling(_) => InputError::new_err(message),
            CoreModelError::Config(_)
            | CoreModelError::Weights(_)
            | CoreModelError::Io(_)
            | CoreModelError::Memory(_) => ModelError::new_err(message),
            CoreModelError::Ring(_) => RingError::new_err(message),
            CoreModelError::Volume(_) => CacheError::new_err(message),
        }
    }
}

impl From<CoreRingError> for PyErr {
    fn from(e: CoreRingError) -> PyErr {
        use CoreRingError as E;
        let message = e.to_string();
        match e {
            E::InvalidConfig(_)
            | E::EmptyAppend
            | E::ChunkTooLarge { .. }
            | E::LayerOutOfRange { .. }
            | E::ShapeMismatch { .. }
            | E::NonFinite { .. } => InputError::new_err(message),
            E::NoOpenSpan
            | E::SpanLongerThanWindow { .. }
            | E::AppendPending
            | E::NoPendingAppend
            | E::LayerAlreadyWritten { .. }
            | E::LayerNotWritten { .. }
            | E::FutureClock { .. }
            | E::RollbackTooFar { .. }
            | E::RecallOverflow { .. }
            | E::PositionNotWritten { .. }
            | E::PositionOverwritten { .. } => RingError::new_err(message),
        }
    }
}

impl From<EngineError> for PyErr {
    fn from(e: EngineError) -> PyErr {
        let message = e.to_string();
        match e {
            EngineError::Input(_) => InputError::new_err(message),
            EngineError::QueueFull { .. } => QueueFullError::new_err(message),
            EngineError::Executor(_) => ModelError::new_err(message),
        }
    }
}

/// Core errors that only ever report bad arguments: each becomes an `InputError`. The
/// volume cache's own API is one of them (`VolumeError` is "bad input to the cache"); what
/// the cache refuses inside the pipeline arrives as `ModelError::Volume`, a `CacheError`.
macro_rules! input_errors {
    ($($error:ty),+ $(,)?) => {$(
        impl From<$error> for PyErr {
            fn from(e: $error) -> PyErr {
                InputError::new_err(e.to_string())
            }
        }
    )+};
}

input_errors!(
    VolumeError,
    MemoError,
    QuantError,
    SamplingError,
    OracleError,
    AttnError,
    UnknownPolicyError,
    GrammarError,
);

/// A cache lock poisoned by a panic in another thread.
pub fn poisoned(what: &str) -> PyErr {
    CacheError::new_err(format!("{what} lock poisoned by a panic"))
}
