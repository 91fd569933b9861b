use super::*;
use crate::mesh::{axis_groups, coords};
use crate::reduce::{finish_avg, reduce_into};
use kolo_base::DType;

#[test]
fn mesh_axis_groups_row_major() {
    // pp=2, dp=2, tp=2 over 8 ranks.
    let shape = [2, 2, 2];
    assert_eq!(coords(&shape, 5), vec![1, 0, 1]);
    assert_eq!(axis_groups(&shape, 2), vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
    assert_eq!(axis_groups(&shape, 1), vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]);
    assert_eq!(axis_groups(&shape, 0), vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
    assert_eq!(axis_groups(&[3], 0), vec![vec![0, 1, 2]]);
    // Every rank is in exactly one group per axis.
    for axis in 0..3 {
        let mut all: Vec<usize> = axis_groups(&shape, axis).concat();
        all.sort();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
    }
}

#[test]
fn reduce_kernels_all_dtypes_and_misaligned() {
    let mut a = vec![1f32, -2.0, 3.0];
    let b = vec![4f32, 5.0, -6.0];
    reduce_into(DType::F32, ReduceOp::Max, BufMut::from(&mut a).bytes_mut(), BufRef::from(&b).bytes());
    assert_eq!(a, vec![4.0, 5.0, 3.0]);
    let mut x = vec![f16::from_f32(1.5), f16::from_f32(2.0)];
    let y = vec![f16::from_f32(2.5), f16::from_f32(-4.0)];
    reduce_into(DType::F16, ReduceOp::Sum, BufMut::from(&mut x).bytes_mut(), BufRef::from(&y).bytes());
    assert_eq!(x, vec![f16::from_f32(4.0), f16::from_f32(-2.0)]);
    let mut i = vec![7i64, -3];
    reduce_into(DType::I64, ReduceOp::Product, BufMut::from(&mut i).bytes_mut(), BufRef::from(&vec![3i64, 3]).bytes());
    finish_avg(DType::I64, ReduceOp::Avg, BufMut::from(&mut i).bytes_mut(), 3);
    assert_eq!(i, vec![7, -3]);
    // Misaligned byte slices take the unaligned path and agree with the aligned one.
    let mut raw = [0u8; 1 + 8];
    raw[1..].copy_from_slice(BufRef::from(&vec![1i32, 2]).bytes());
    reduce_into(DType::I32, ReduceOp::Sum, &mut raw[1..], BufRef::from(&vec![10i32, 20]).bytes());
    assert_eq!(&raw[1..], BufRef::from(&vec![11i32, 22]).bytes());
}

#[test]
fn fingerprint_round_trips() {
    let f = Fingerprint { op: OpKind::Reduce, dtype: Some(DType::BF16), count: 97, extra: 3 << 8 | 1 };
    assert_eq!(Fingerprint::from_words(&f.to_words()), Some(f));
    assert_eq!(f.to_string(), "reduce(bf16 x 97, root 3)");
    assert_eq!(Fingerprint::from_words(&[99, 0, 0, 0]), None);
}
