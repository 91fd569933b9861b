//! Element-wise reduction kernels over typed byte buffers.

use half::{bf16, f16};
use kolo_base::DType;
use std::fmt;

/// How `all_reduce`, `reduce` and `reduce_scatter` combine contributions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// Sum, then divide by the group size (integer division for integer types).
    Avg,
    Min,
    Max,
    Product,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max, ReduceOp::Product];

    pub fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Avg => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
            ReduceOp::Product => 5,
        }
    }

    /// The op of a [`ReduceOp::code`] (wire headers).
    pub fn from_code(c: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|o| o.code() == c)
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Product => "product",
        })
    }
}

impl std::str::FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ReduceOp::ALL
            .into_iter()
            .find(|o| o.to_string() == s)
            .ok_or_else(|| format!("unknown reduce op `{s}` (sum, avg, min, max, product)"))
    }
}

trait Num: Copy {
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn min(self, o: Self) -> Self;
    fn max(self, o: Self) -> Self;
    fn div_n(self, n: usize) -> Self;
}

macro_rules! float_num {
    ($t:ty) => {
        impl Num for $t {
            fn add(self, o: Self) -> Self {
                self + o
            }
            fn mul(self, o: Self) -> Self {
                self * o
            }
            fn min(self, o: Self) -> Self {
                if o < self {
                    o
                } else {
                    self
                }
            }
            fn max(self, o: Self) -> Self {
                if o > self {
                    o
                } else {
                    self
                }
            }
            fn div_n(self, n: usize) -> Self {
                self / (n as $t)
            }
        }
    };
}
float_num!(f32);
float_num!(f64);

macro_rules! half_num {
    ($t:ty) => {
        impl Num for $t {
            fn add(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() + o.to_f32())
            }
            fn mul(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() * o.to_f32())
            }
            fn min(self, o: Self) -> Self {
                if o < self {
                    o
                } else {
                    self
                }
            }
            fn max(self, o: Self) -> Self {
                if o > self {
                    o
                } else {
                    self
                }
            }
            fn div_n(self, n: usize) -> Self {
                <$t>::from_f32(self.to_f32() / n as f32)
            }
        }
    };
}
half_num!(f16);
half_num!(bf16);

macro_rules! int_num {
    ($t:ty) => {
        impl Num for $t {
            fn add(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            fn mul(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            fn min(self, o: Self) -> Self {
                Ord::min(self, o)
            }
            fn max(self, o: Self) -> Self {
                Ord::max(self, o)
            }
            fn div_n(self, n: usize) -> Self {
                self / (n as $t)
            }
        }
    };
}
int_num!(i32);
int_num!(i64);
int_num!(u8);

#[inline]
fn zip_apply<T: Num>(dst: &mut [u8], src: &[u8], f: impl Fn(T, T) -> T) {
    let sz = std::mem::size_of::<T>();
    debug_assert_eq!(dst.len(), src.len());
    debug_assert_eq!(dst.len() % sz, 0);
    let n = dst.len() / sz;
    let aligned = (dst.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
        && (src.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>());
    if aligned {
        // SAFETY: both slices are aligned for T, hold `n` whole elements, and T is plain old
        // data, so these typed views are valid for the borrows' lifetimes.
        let d = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<T>(), n) };
        let s = unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<T>(), n) };
        for (a, b) in d.iter_mut().zip(s) {
            *a = f(*a, *b);
        }
    } else {
        for i in 0..n {
            // SAFETY: `i * sz + sz <= len` for both slices; unaligned reads/writes of POD.
            unsafe {
                let pd = dst.as_mut_ptr().add(i * sz).cast::<T>();
                let ps = src.as_ptr().add(i * sz).cast::<T>();
                pd.write_unaligned(f(pd.read_unaligned(), ps.read_unaligned()));
            }
        }
    }
}

fn reduce_typed<T: Num>(op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => zip_apply::<T>(dst, src, T::add),
        ReduceOp::Product => zip_apply::<T>(dst, src, T::mul),
        ReduceOp::Min => zip_apply::<T>(dst, src, T::min),
        ReduceOp::Max => zip_apply::<T>(dst, src, T::max),
    }
}

/// `dst[i] = dst[i] (op) src[i]` element-wise. For `Avg` this sums; call [`finish_avg`] once at
/// the end. Both slices must have the same length, a multiple of the element size.
pub fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "reduce_into: length mismatch");
    match dtype {
        DType::F32 => reduce_typed::<f32>(op, dst, src),
        DType::F64 => reduce_typed::<f64>(op, dst, src),
        DType::F16 => reduce_typed::<f16>(op, dst, src),
        DType::BF16 => reduce_typed::<bf16>(op, dst, src),
        DType::I32 => reduce_typed::<i32>(op, dst, src),
        DType::I64 => reduce_typed::<i64>(op, dst, src),
        DType::U8 => reduce_typed::<u8>(op, dst, src),
    }
}

fn div_typed<T: Num>(buf: &mut [u8], n: usize) {
    let sz = std::mem::size_of::<T>();
    for i in 0..buf.len() / sz {
        // SAFETY: whole elements within bounds; unaligned access of POD.
        unsafe {
            let p = buf.as_mut_ptr().add(i * sz).cast::<T>();
            p.write_unaligned(p.read_unaligned().div_n(n));
        }
    }
}

/// Turns a sum into an average over `n` contributions (no-op for other ops).
pub fn finish_avg(dtype: DType, op: ReduceOp, buf: &mut [u8], n: usize) {
    if op != ReduceOp::Avg || n <= 1 {
        return;
    }
    match dtype {
        DType::F32 => div_typed::<f32>(buf, n),
        DType::F64 => div_typed::<f64>(buf, n),
        DType::F16 => div_typed::<f16>(buf, n),
        DType::BF16 => div_typed::<bf16>(buf, n),
        DType::I32 => div_typed::<i32>(buf, n),
        DType::I64 => div_typed::<i64>(buf, n),
        DType::U8 => div_typed::<u8>(buf, n),
    }
}
