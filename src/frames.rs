//! Stack frames of allocation contexts (PyTorch's
//! `_record_memory_history(stacks="python")`): owns the registry of
//! context id → frames, kept for the allocator's life. A caller registers
//! the frames of a context once and allocates with its id; the heaps keep
//! only the id of each live block, and snapshots look the frames up here.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::Arc;

use crate::sync::Mutex;

use crate::error::{AllocError, InvalidArgument};

/// One stack frame, as PyTorch's snapshots list it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub filename: String,
    pub name: String,
    pub line: i64,
}

/// The frames of every registered context.
#[derive(Default)]
pub struct Contexts {
    frames: Mutex<HashMap<u64, Arc<[Frame]>>>,
}

impl Contexts {
    /// Registers the frames of `context` (innermost first), replacing any
    /// registered before. Context 0 means "none" and is refused.
    pub fn register(&self, context: u64, frames: Vec<Frame>) -> Result<(), AllocError> {
        if context == 0 {
            return Err(AllocError::InvalidArgument(InvalidArgument::ContextZero));
        }
        self.frames.lock().insert(context, frames.into());
        Ok(())
    }

    /// The frames of `context`: none for 0 or a context never registered.
    pub fn frames(&self, context: u64) -> Arc<[Frame]> {
        self.frames.lock().get(&context).cloned().unwrap_or_else(|| Arc::new([]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(line: i64) -> Frame {
        Frame { filename: "train.py".into(), name: "step".into(), line }
    }

    #[test]
    fn a_registration_replaces_the_last_one_and_unknown_contexts_have_no_frames() {
        let contexts = Contexts::default();
        contexts.register(7, vec![frame(1), frame(2)]).unwrap();
        contexts.register(7, vec![frame(3)]).unwrap();
        assert_eq!(&*contexts.frames(7), &[frame(3)]);
        assert!(contexts.frames(8).is_empty());
        assert!(contexts.frames(0).is_empty());
        assert!(contexts.register(0, vec![frame(1)]).is_err());
    }
}
