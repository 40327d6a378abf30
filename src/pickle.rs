//! Python's pickle format for plain data (None, bool, int, float, str,
//! list, tuple, dict), written for snapshots (protocol 2): nothing that
//! names a class or function, so any unpickler that refuses globals loads
//! them. (Reading PyTorch's snapshots is the tools' job.)
#![forbid(unsafe_code)]

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

const PROTO: u8 = 0x80;
const STOP: u8 = b'.';
const NONE: u8 = b'N';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const BINFLOAT: u8 = b'G';
const BINUNICODE: u8 = b'X';
const EMPTY_LIST: u8 = b']';
const APPENDS: u8 = b'e';
const EMPTY_TUPLE: u8 = b')';
const TUPLE: u8 = b't';
const EMPTY_DICT: u8 = b'}';
const SETITEMS: u8 = b'u';
const MARK: u8 = b'(';

/// The pickle of `value`, protocol 2.
pub fn dumps(value: &PyValue) -> Vec<u8> {
    let mut out = vec![PROTO, 2];
    write(&mut out, value);
    out.push(STOP);
    out
}

fn write(out: &mut Vec<u8>, value: &PyValue) {
    match value {
        PyValue::None => out.push(NONE),
        PyValue::Bool(b) => out.push(if *b { NEWTRUE } else { NEWFALSE }),
        PyValue::Int(v) => match i32::try_from(*v) {
            Ok(small) => {
                out.push(BININT);
                out.extend_from_slice(&small.to_le_bytes());
            }
            Err(_) => {
                let bytes = long_bytes(*v);
                out.push(LONG1);
                out.push(bytes.len() as u8);
                out.extend_from_slice(&bytes);
            }
        },
        PyValue::Float(f) => {
            out.push(BINFLOAT);
            out.extend_from_slice(&f.to_be_bytes());
        }
        PyValue::Str(s) => {
            out.push(BINUNICODE);
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        PyValue::List(items) => {
            out.push(EMPTY_LIST);
            if !items.is_empty() {
                out.push(MARK);
                items.iter().for_each(|item| write(out, item));
                out.push(APPENDS);
            }
        }
        PyValue::Tuple(items) => {
            if items.is_empty() {
                out.push(EMPTY_TUPLE);
            } else {
                out.push(MARK);
                items.iter().for_each(|item| write(out, item));
                out.push(TUPLE);
            }
        }
        PyValue::Dict(items) => {
            out.push(EMPTY_DICT);
            if !items.is_empty() {
                out.push(MARK);
                for (k, v) in items {
                    write(out, k);
                    write(out, v);
                }
                out.push(SETITEMS);
            }
        }
    }
}

/// Little-endian two's complement in the fewest bytes, as LONG1 wants.
fn long_bytes(v: i128) -> Vec<u8> {
    let mut bytes = v.to_le_bytes().to_vec();
    while bytes.len() > 1 {
        let last = bytes[bytes.len() - 1];
        let sign_of_rest = bytes[bytes.len() - 2] & 0x80;
        if (last == 0 && sign_of_rest == 0) || (last == 0xff && sign_of_rest != 0) {
            bytes.pop();
        } else {
            break;
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longs_use_the_fewest_two_complement_bytes() {
        assert_eq!(long_bytes(0), vec![0]);
        assert_eq!(long_bytes(255), vec![0xff, 0x00]);
        assert_eq!(long_bytes(-1), vec![0xff]);
        assert_eq!(long_bytes(1 << 40), vec![0, 0, 0, 0, 0, 1]);
        assert_eq!(long_bytes(u64::MAX as i128), vec![0xff; 8].into_iter().chain([0]).collect::<Vec<_>>());
    }

    #[test]
    fn a_small_dict_pickles_to_the_bytes_python_expects() {
        // pickle.dumps({'a': [1, None, True]}, protocol=2) minus the memo
        // opcodes Python adds, which a loader does not need.
        let value = PyValue::dict([("a", PyValue::List(vec![PyValue::int(1), PyValue::None, PyValue::Bool(true)]))]);
        let expected: Vec<u8> =
            [&[0x80, 2, b'}', b'(', b'X', 1, 0, 0, 0, b'a', b']', b'('][..], &[b'J', 1, 0, 0, 0, b'N', 0x88, b'e', b'u', b'.'][..]]
                .concat();
        assert_eq!(dumps(&value), expected);
    }
}
