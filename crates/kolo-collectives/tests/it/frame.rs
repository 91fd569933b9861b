use kolo_base::DType;
use kolo_collectives::frame::{Header, HEADER_LEN, MAX_MESSAGE};
use kolo_comm::{OpKind, ReduceOp};
use proptest::prelude::*;

proptest! {
    #[test]
    fn decoder_never_panics_on_garbage(bytes in proptest::array::uniform32(any::<u8>()), tail in proptest::array::uniform8(any::<u8>())) {
        let mut b = [0u8; HEADER_LEN];
        b[..32].copy_from_slice(&bytes);
        b[32..].copy_from_slice(&tail);
        let _ = Header::decode(&b);
    }

    #[test]
    fn headers_round_trip_and_single_bit_flips_are_caught(seq in any::<u64>(), step in any::<u32>(), tag in any::<u32>(),
            len in 0..=MAX_MESSAGE, bit in 0usize..(HEADER_LEN * 8), red in 0usize..6, root in proptest::option::of(0u32..(1 << 24) - 2)) {
        let red = red.checked_sub(1).map(|i| ReduceOp::ALL[i]);
        let h = Header { op: OpKind::AllReduce, dtype: Some(DType::BF16), alg: 1, seq, step, tag, len, red, root };
        let mut b = h.encode();
        prop_assert_eq!(Header::decode(&b).unwrap(), h);
        b[bit / 8] ^= 1 << (bit % 8);
        prop_assert!(Header::decode(&b).is_err());
    }
}

#[test]
fn oversized_length_is_rejected() {
    let h = Header { op: OpKind::Send, dtype: None, alg: 0, seq: 0, step: 0, tag: 0, len: MAX_MESSAGE + 1, red: None, root: None };
    let err = Header::decode(&h.encode()).unwrap_err();
    assert!(err.contains("limit"), "{err}");
}
