//! Reading Python pickles of plain data (PyTorch's memory snapshots) into
//! an arena of nodes.
//!
//! Shared objects (the memo: PyTorch snapshots reference the same frame
//! lists thousands of times) stay shared: a node is stored once and
//! referenced by id, so memory grows with the file, not with its
//! references. The parser is a loop over opcodes with an explicit stack (no
//! recursion, whatever the nesting), reads through a `Read` (no whole-file
//! buffer), and refuses every opcode that would name a class or call one.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fmt;
use std::io::{self, BufRead, Read};

/// Index of a node in a `PickleDoc`.
pub type NodeId = u32;

/// One Python value; containers hold ids of other nodes.
#[derive(Clone, Debug, PartialEq)]
pub enum Node {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<NodeId>),
    Tuple(Vec<NodeId>),
    Dict(Vec<(NodeId, NodeId)>),
}

/// Why a pickle was refused, with the byte offset of the opcode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PickleError {
    pub offset: u64,
    pub message: String,
}

impl fmt::Display for PickleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "at byte {}: {}", self.offset, self.message)
    }
}

impl std::error::Error for PickleError {}

/// A parsed pickle.
#[derive(Debug)]
pub struct PickleDoc {
    nodes: Vec<Node>,
    root: NodeId,
}

/// Longest integer accepted (LONG1/LONG4): i128 holds 16 bytes.
const MAX_LONG_BYTES: usize = 16;

struct Parser<R> {
    input: R,
    offset: u64,
    nodes: Vec<Node>,
    /// None marks a MARK.
    stack: Vec<Option<NodeId>>,
    memo: HashMap<u32, NodeId>,
    opcode_at: u64,
}

impl<R: BufRead> Parser<R> {
    fn fail<T>(&self, message: impl Into<String>) -> Result<T, PickleError> {
        Err(PickleError { offset: self.opcode_at, message: message.into() })
    }

    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], PickleError> {
        let mut buf = [0u8; N];
        match self.input.read_exact(&mut buf) {
            Ok(()) => {
                self.offset += N as u64;
                Ok(buf)
            }
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => self.fail("truncated: the file ends inside an opcode"),
            Err(e) => self.fail(format!("read error: {e}")),
        }
    }

    /// `len` bytes, read incrementally so a lying length costs only what the file holds.
    fn blob(&mut self, len: u64) -> Result<Vec<u8>, PickleError> {
        let mut out = Vec::new();
        let got = (&mut self.input).take(len).read_to_end(&mut out);
        match got {
            Ok(n) if n as u64 == len => {
                self.offset += len;
                Ok(out)
            }
            Ok(_) => self.fail(format!("truncated: a {len}-byte value runs past the end of the file")),
            Err(e) => self.fail(format!("read error: {e}")),
        }
    }

    fn push(&mut self, node: Node) {
        self.nodes.push(node);
        self.stack.push(Some((self.nodes.len() - 1) as NodeId));
    }

    fn pop(&mut self) -> Result<NodeId, PickleError> {
        match self.stack.pop() {
            Some(Some(id)) => Ok(id),
            Some(None) => self.fail("a MARK where a value was expected"),
            None => self.fail("stack underflow"),
        }
    }

    fn top(&self) -> Result<NodeId, PickleError> {
        match self.stack.last() {
            Some(Some(id)) => Ok(*id),
            _ => self.fail("no value on the stack"),
        }
    }

    /// Everything above the topmost MARK, which is removed.
    fn pop_to_mark(&mut self) -> Result<Vec<NodeId>, PickleError> {
        let Some(mark) = self.stack.iter().rposition(Option::is_none) else {
            return self.fail("no MARK on the stack");
        };
        let items = self.stack.split_off(mark + 1).into_iter().flatten().collect();
        self.stack.pop();
        Ok(items)
    }

    fn text(&mut self, len: u64) -> Result<(), PickleError> {
        let raw = self.blob(len)?;
        match String::from_utf8(raw) {
            Ok(s) => {
                self.push(Node::Str(s));
                Ok(())
            }
            Err(_) => self.fail("a string that is not UTF-8"),
        }
    }

    fn long(&mut self, len: usize) -> Result<(), PickleError> {
        if len > MAX_LONG_BYTES {
            return self.fail(format!("an integer of {len} bytes is too large"));
        }
        let raw = self.blob(len as u64)?;
        let mut bytes = [0u8; 16];
        bytes[..len].copy_from_slice(&raw);
        if len > 0 && raw[len - 1] & 0x80 != 0 {
            bytes[len..].fill(0xff);
        }
        self.push(Node::Int(i128::from_le_bytes(bytes)));
        Ok(())
    }

    fn extend(&mut self, container: NodeId, items: Vec<NodeId>) -> Result<(), PickleError> {
        match &mut self.nodes[container as usize] {
            Node::List(list) => {
                list.extend(items);
                Ok(())
            }
            _ => self.fail("APPEND to something that is not a list"),
        }
    }

    fn set_items(&mut self, container: NodeId, items: Vec<NodeId>) -> Result<(), PickleError> {
        if !items.len().is_multiple_of(2) {
            return self.fail("SETITEMS with an odd number of values");
        }
        match &mut self.nodes[container as usize] {
            Node::Dict(dict) => {
                dict.extend(items.chunks_exact(2).map(|kv| (kv[0], kv[1])));
                Ok(())
            }
            _ => self.fail("SETITEM on something that is not a dict"),
        }
    }

    fn memo_get(&mut self, index: u32) -> Result<(), PickleError> {
        match self.memo.get(&index) {
            Some(&id) => {
                self.stack.push(Some(id));
                Ok(())
            }
            None => self.fail(format!("memo entry {index} was never stored")),
        }
    }

    /// Runs the opcodes to STOP: the document.
    fn run(mut self) -> Result<PickleDoc, PickleError> {
        loop {
            self.opcode_at = self.offset;
            let [op] = match self.bytes::<1>() {
                Ok(b) => b,
                Err(_) => return self.fail("truncated: the file ends before STOP"),
            };
            match op {
                0x80 | 0x95 | b'}' | b']' | b')' | b'(' | b'N' | 0x88 | 0x89 | b'K' | b'M' | b'J' | 0x8a | 0x8b | b'G' => {
                    self.scalar(op)?
                }
                0x8c | b'X' | 0x8d | b'C' | b'B' | 0x8e => self.string(op)?,
                0x85..=0x87 | b't' | b'a' | b'e' | b's' | b'u' => self.container(op)?,
                0x94 | b'q' | b'r' | b'h' | b'j' | b'0' => self.memo_or_pop(op)?,
                b'.' => {
                    let root = self.pop()?;
                    return Ok(PickleDoc { nodes: self.nodes, root });
                }
                b'c' | 0x93 | b'R' | b'b' | 0x81 | 0x92 | b'i' | b'o' | b'P' | b'Q' | 0x82..=0x84 => {
                    return self.fail(format!("opcode {op:#04x} refers to a class or function: refused (only plain data is read)"));
                }
                other => return self.fail(format!("unknown or unsupported opcode {other:#04x}")),
            }
        }
    }

    /// The protocol and frame opcodes, a mark, and those that push a
    /// number, a boolean, None or an empty container.
    fn scalar(&mut self, op: u8) -> Result<(), PickleError> {
        match op {
            0x80 => {
                let [version] = self.bytes::<1>()?;
                if version > 5 {
                    return self.fail(format!("pickle protocol {version} is not supported"));
                }
            }
            0x95 => {
                self.bytes::<8>()?; // FRAME: a length hint only
            }
            b'}' => self.push(Node::Dict(Vec::new())),
            b']' => self.push(Node::List(Vec::new())),
            b')' => self.push(Node::Tuple(Vec::new())),
            b'(' => self.stack.push(None),
            b'N' => self.push(Node::None),
            0x88 => self.push(Node::Bool(true)),
            0x89 => self.push(Node::Bool(false)),
            b'K' => {
                let [v] = self.bytes::<1>()?;
                self.push(Node::Int(v as i128));
            }
            b'M' => {
                let v = u16::from_le_bytes(self.bytes::<2>()?);
                self.push(Node::Int(v as i128));
            }
            b'J' => {
                let v = i32::from_le_bytes(self.bytes::<4>()?);
                self.push(Node::Int(v as i128));
            }
            0x8a => {
                let [n] = self.bytes::<1>()?;
                self.long(n as usize)?;
            }
            0x8b => {
                let n = i32::from_le_bytes(self.bytes::<4>()?);
                self.long(usize::try_from(n).unwrap_or(usize::MAX))?;
            }
            b'G' => {
                let v = f64::from_be_bytes(self.bytes::<8>()?);
                self.push(Node::Float(v));
            }
            other => return self.fail(format!("unknown or unsupported opcode {other:#04x}")),
        }
        Ok(())
    }

    /// The opcodes that push a string or bytes.
    fn string(&mut self, op: u8) -> Result<(), PickleError> {
        match op {
            0x8c => {
                let [n] = self.bytes::<1>()?;
                self.text(n as u64)
            }
            b'X' => {
                let n = u32::from_le_bytes(self.bytes::<4>()?);
                self.text(n as u64)
            }
            0x8d => {
                let n = u64::from_le_bytes(self.bytes::<8>()?);
                self.text(n)
            }
            b'C' | b'B' | 0x8e => {
                let n = match op {
                    b'C' => self.bytes::<1>()?[0] as u64,
                    b'B' => u32::from_le_bytes(self.bytes::<4>()?) as u64,
                    _ => u64::from_le_bytes(self.bytes::<8>()?),
                };
                let raw = self.blob(n)?;
                self.push(Node::Bytes(raw));
                Ok(())
            }
            other => self.fail(format!("unknown or unsupported opcode {other:#04x}")),
        }
    }

    /// The opcodes that build a tuple, or fill a list or a dict.
    fn container(&mut self, op: u8) -> Result<(), PickleError> {
        match op {
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                if self.stack.len() < n {
                    return self.fail("stack underflow");
                }
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.pop()?);
                }
                items.reverse();
                self.push(Node::Tuple(items));
                Ok(())
            }
            b't' => {
                let items = self.pop_to_mark()?;
                self.push(Node::Tuple(items));
                Ok(())
            }
            b'a' => {
                let item = self.pop()?;
                let list = self.top()?;
                self.extend(list, vec![item])
            }
            b'e' => {
                let items = self.pop_to_mark()?;
                let list = self.top()?;
                self.extend(list, items)
            }
            b's' => {
                let value = self.pop()?;
                let key = self.pop()?;
                let dict = self.top()?;
                self.set_items(dict, vec![key, value])
            }
            b'u' => {
                let items = self.pop_to_mark()?;
                let dict = self.top()?;
                self.set_items(dict, items)
            }
            other => self.fail(format!("unknown or unsupported opcode {other:#04x}")),
        }
    }

    /// The memo's opcodes (store the top, push a stored node) and POP.
    fn memo_or_pop(&mut self, op: u8) -> Result<(), PickleError> {
        match op {
            0x94 => {
                let id = self.top()?;
                let index = self.memo.len() as u32;
                self.memo.insert(index, id);
            }
            b'q' => {
                let [i] = self.bytes::<1>()?;
                let id = self.top()?;
                self.memo.insert(i as u32, id);
            }
            b'r' => {
                let i = u32::from_le_bytes(self.bytes::<4>()?);
                let id = self.top()?;
                self.memo.insert(i, id);
            }
            b'h' => {
                let [i] = self.bytes::<1>()?;
                self.memo_get(i as u32)?;
            }
            b'j' => {
                let i = u32::from_le_bytes(self.bytes::<4>()?);
                self.memo_get(i)?;
            }
            b'0' => {
                self.pop()?;
            }
            other => return self.fail(format!("unknown or unsupported opcode {other:#04x}")),
        }
        Ok(())
    }
}

impl PickleDoc {
    /// Parses one pickle from `input`.
    pub fn parse(input: impl Read) -> Result<PickleDoc, PickleError> {
        let parser = Parser {
            input: io::BufReader::new(input),
            offset: 0,
            nodes: Vec::new(),
            stack: Vec::new(),
            memo: HashMap::new(),
            opcode_at: 0,
        };
        parser.run()
    }

    pub fn root(&self) -> NodeId {
        self.root
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    /// The value under the string key `key` of a dict node.
    pub fn get(&self, dict: NodeId, key: &str) -> Option<NodeId> {
        match self.node(dict) {
            Node::Dict(items) => items.iter().find(|(k, _)| self.str(*k) == Some(key)).map(|&(_, v)| v),
            _ => None,
        }
    }

    pub fn int(&self, id: NodeId) -> Option<i128> {
        match self.node(id) {
            Node::Int(v) => Some(*v),
            Node::Bool(b) => Some(*b as i128),
            _ => None,
        }
    }

    pub fn str(&self, id: NodeId) -> Option<&str> {
        match self.node(id) {
            Node::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The items of a list or tuple node.
    pub fn items(&self, id: NodeId) -> Option<&[NodeId]> {
        match self.node(id) {
            Node::List(items) | Node::Tuple(items) => Some(items),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidepool::pickle::{dumps, PyValue};

    fn parse(bytes: &[u8]) -> Result<PickleDoc, PickleError> {
        PickleDoc::parse(bytes)
    }

    #[test]
    fn what_the_writer_writes_reads_back() {
        let value = PyValue::dict([
            ("a", PyValue::List(vec![PyValue::int(1), PyValue::int(-5), PyValue::int(1u64 << 40), PyValue::None])),
            ("b", PyValue::Tuple(vec![PyValue::str("x"), PyValue::Bool(false), PyValue::Float(2.5)])),
        ]);
        let doc = parse(&dumps(&value)).unwrap();
        let a = doc.get(doc.root(), "a").unwrap();
        let ints: Vec<_> = doc.items(a).unwrap().iter().map(|&i| doc.int(i)).collect();
        assert_eq!(ints, vec![Some(1), Some(-5), Some(1 << 40), None]);
        let b = doc.items(doc.get(doc.root(), "b").unwrap()).unwrap().to_vec();
        assert_eq!(doc.str(b[0]), Some("x"));
        assert_eq!(doc.node(b[2]), &Node::Float(2.5));
    }

    #[test]
    fn memoized_values_are_shared_not_copied() {
        // Python: x = [1]; pickle.dumps([x, x], protocol=4) (frame elided)
        let bytes = b"\x80\x04]\x94(]\x94K\x01ah\x01e.";
        let doc = parse(bytes).unwrap();
        let items = doc.items(doc.root()).unwrap();
        assert_eq!(items[0], items[1]);
    }

    #[test]
    fn a_class_reference_is_refused_with_its_offset() {
        // Python: pickle.dumps(os.system, protocol=2) starts with PROTO 2, GLOBAL
        let err = parse(b"\x80\x02cposix\nsystem\nq\x00.").unwrap_err();
        assert_eq!(err.offset, 2);
        assert!(err.message.contains("refused"), "{err}");
        let err = parse(b"\x80\x04\x8c\x02os\x8c\x06system\x93.").unwrap_err();
        assert!(err.message.contains("class or function"), "{err}");
    }

    #[test]
    fn truncated_and_garbage_input_are_errors_not_panics() {
        assert!(parse(b"").unwrap_err().message.contains("before STOP"));
        assert!(parse(b"\x80\x04X\xff\xff\xff\xffab").unwrap_err().message.contains("truncated"));
        assert!(parse(b"\x80\x04\x8a\x40").unwrap_err().message.contains("too large"));
        assert!(parse(b"e.").is_err());
        assert!(parse(b"h\x05.").unwrap_err().message.contains("memo"));
        assert!(parse(b"K\x01K\x02u.").is_err());
        // Random bytes: any outcome but a panic.
        let mut seed = 0x1234_5678u64;
        for _ in 0..2000 {
            let junk: Vec<u8> = (0..64)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            let _ = parse(&junk);
        }
    }
}
