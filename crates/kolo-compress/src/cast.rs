//! Half-precision casts of gradients (2 bytes per value on the wire).

use half::{bf16, f16};

pub fn to_f16(x: &[f32]) -> Vec<f16> {
    x.iter().map(|v| f16::from_f32(*v)).collect()
}

pub fn from_f16(x: &[f16], out: &mut [f32]) {
    out.iter_mut().zip(x).for_each(|(o, v)| *o = v.to_f32());
}

pub fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|v| bf16::from_f32(*v)).collect()
}

pub fn from_bf16(x: &[bf16], out: &mut [f32]) {
    out.iter_mut().zip(x).for_each(|(o, v)| *o = v.to_f32());
}
