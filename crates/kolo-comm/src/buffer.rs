//! Typed byte buffers: what the communicator moves. A `BufMut` is a `&mut [T]` with its element
//! type erased to a [`DType`] tag, so that `Communicator` stays object-safe and tensor-library-free.

use half::{bf16, f16};
use kolo_base::DType;

mod sealed {
    pub trait Sealed {}
}

/// Plain-old-data element types with a [`DType`]. Every bit pattern is a valid value.
pub trait Element: Copy + Send + Sync + Default + PartialEq + std::fmt::Debug + 'static + sealed::Sealed {
    const DTYPE: DType;
    /// Converts a small integer exactly (used by tests and the bench's correctness check).
    fn from_i64(v: i64) -> Self;
    /// Rounds to the nearest value of this type (integers: towards zero; used by tests).
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
}

macro_rules! element {
    ($t:ty, $d:expr, $from:expr, $from_f:expr, $to:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
            fn from_i64(v: i64) -> Self {
                $from(v)
            }
            fn from_f64(v: f64) -> Self {
                $from_f(v)
            }
            fn to_f64(self) -> f64 {
                $to(self)
            }
        }
    };
}

element!(f32, DType::F32, |v| v as f32, |v| v as f32, |x: f32| x as f64);
element!(f64, DType::F64, |v| v as f64, |v| v, |x: f64| x);
element!(f16, DType::F16, |v| f16::from_f64(v as f64), f16::from_f64, |x: f16| x.to_f64());
element!(bf16, DType::BF16, |v| bf16::from_f64(v as f64), bf16::from_f64, |x: bf16| x.to_f64());
element!(i32, DType::I32, |v| v as i32, |v| v as i32, |x: i32| x as f64);
element!(i64, DType::I64, |v| v, |v| v as i64, |x: i64| x as f64);
element!(u8, DType::U8, |v| v as u8, |v| v as u8, |x: u8| x as f64);

fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: Element types are plain old data without padding; the byte view covers exactly the
    // same memory and lifetime as the typed slice.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as above; every byte pattern written through the view is a valid T.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// A read-only typed buffer.
#[derive(Clone, Copy, Debug)]
pub struct BufRef<'a> {
    dtype: DType,
    bytes: &'a [u8],
}

/// A writable typed buffer.
#[derive(Debug)]
pub struct BufMut<'a> {
    dtype: DType,
    bytes: &'a mut [u8],
}

impl<'a> BufRef<'a> {
    /// `bytes.len()` must be a multiple of the element size.
    pub fn from_bytes(dtype: DType, bytes: &'a [u8]) -> Option<BufRef<'a>> {
        bytes.len().is_multiple_of(dtype.size_bytes()).then_some(BufRef { dtype, bytes })
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size_bytes()
    }
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }
}

impl<'a> BufMut<'a> {
    pub fn from_bytes(dtype: DType, bytes: &'a mut [u8]) -> Option<BufMut<'a>> {
        bytes.len().is_multiple_of(dtype.size_bytes()).then_some(BufMut { dtype, bytes })
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size_bytes()
    }
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
    pub fn bytes(&self) -> &[u8] {
        self.bytes
    }
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
    pub fn into_bytes(self) -> &'a mut [u8] {
        self.bytes
    }
    pub fn as_ref(&self) -> BufRef<'_> {
        BufRef { dtype: self.dtype, bytes: self.bytes }
    }
    /// A shorter-lived copy of this borrow, so a buffer can be handed to several calls in turn.
    pub fn reborrow(&mut self) -> BufMut<'_> {
        BufMut { dtype: self.dtype, bytes: self.bytes }
    }
}

impl<'a, T: Element> From<&'a [T]> for BufRef<'a> {
    fn from(s: &'a [T]) -> Self {
        BufRef { dtype: T::DTYPE, bytes: as_bytes(s) }
    }
}

impl<'a, T: Element> From<&'a Vec<T>> for BufRef<'a> {
    fn from(s: &'a Vec<T>) -> Self {
        BufRef::from(s.as_slice())
    }
}

impl<'a, T: Element> From<&'a mut [T]> for BufMut<'a> {
    fn from(s: &'a mut [T]) -> Self {
        BufMut { dtype: T::DTYPE, bytes: as_bytes_mut(s) }
    }
}

impl<'a, T: Element> From<&'a mut Vec<T>> for BufMut<'a> {
    fn from(s: &'a mut Vec<T>) -> Self {
        BufMut::from(s.as_mut_slice())
    }
}

/// Byte scratch space aligned to 8 bytes, so typed reductions over it can use aligned loads.
#[derive(Default, Debug)]
pub struct Scratch {
    words: Vec<u64>,
}

impl Scratch {
    /// A byte slice of exactly `len` bytes; grows (never shrinks) the backing store.
    pub fn get(&mut self, len: usize) -> &mut [u8] {
        let words = len.div_ceil(8);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        // SAFETY: u64 storage viewed as bytes; `len <= words * 8`.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), len) }
    }
}
