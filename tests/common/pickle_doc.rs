//! The snapshots tidepool writes, read back with serde-pickle (an
//! unpickler that is not tidepool's) and walked by key: `doc.get(node,
//! "segments")`, `doc.items(list)`, `doc.int(node)`, `doc.str(node)`.

use std::io::Read;

use serde_pickle::{DeOptions, HashableValue, Value};

/// A node of the document: a reference into it (documents live as long as
/// the test process, so that references to them need no lifetime).
pub type NodeId = &'static Value;

pub struct PickleDoc(&'static Value);

impl PickleDoc {
    /// Reads a pickle; a class or function named in it is an error
    /// (serde-pickle's default), as tidepool's snapshots name none.
    pub fn parse(input: impl Read) -> Result<PickleDoc, serde_pickle::Error> {
        serde_pickle::value_from_reader(input, DeOptions::new()).map(|value| PickleDoc(Box::leak(Box::new(value))))
    }

    pub fn root(&self) -> NodeId {
        self.0
    }

    /// The value of `key` in the dict `dict`.
    pub fn get(&self, dict: NodeId, key: &str) -> Option<NodeId> {
        match dict {
            Value::Dict(items) => items.get(&HashableValue::String(key.to_string())),
            _ => None,
        }
    }

    pub fn int(&self, node: NodeId) -> Option<i128> {
        match node {
            Value::I64(v) => Some(*v as i128),
            Value::Int(v) => v.to_string().parse().ok(),
            _ => None,
        }
    }

    pub fn str(&self, node: NodeId) -> Option<&'static str> {
        match node {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The items of a list or tuple.
    pub fn items(&self, node: NodeId) -> Option<Vec<NodeId>> {
        match node {
            Value::List(items) | Value::Tuple(items) => Some(items.iter().collect()),
            _ => None,
        }
    }
}
