//! Python's pickle format for plain data (None, bool, int, float, str,
//! bytes, list, tuple, dict): written for snapshots, read for PyTorch's
//! memory snapshots. Nothing that names a class or function is ever
//! written, and the reader refuses it.
#![forbid(unsafe_code)]

pub mod read;
pub mod write;

pub use read::{Node, NodeId, PickleDoc, PickleError};
pub use write::dumps;

/// A plain Python value.
#[derive(Clone, Debug, PartialEq)]
pub enum PyValue {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    List(Vec<PyValue>),
    Tuple(Vec<PyValue>),
    /// Keys in insertion order, as Python dicts keep them.
    Dict(Vec<(PyValue, PyValue)>),
}

impl PyValue {
    pub fn str(s: impl Into<String>) -> PyValue {
        PyValue::Str(s.into())
    }

    pub fn int(v: impl Into<i128>) -> PyValue {
        PyValue::Int(v.into())
    }

    /// A dict with string keys.
    pub fn dict<'a>(items: impl IntoIterator<Item = (&'a str, PyValue)>) -> PyValue {
        PyValue::Dict(items.into_iter().map(|(k, v)| (PyValue::str(k), v)).collect())
    }
}
