use super::{uniform_fan_in, Input, Model};
use crate::ops::linear;
use crate::{ParamSet, ParamView, Result, TensorError};
use candle_core::Tensor;
use kolo_base::Rng;

/// A small MNIST CNN: conv5x5(1->c1) ReLU maxpool2, conv5x5(c1->c2) ReLU maxpool2, linear.
pub struct Cnn {
    params: ParamSet,
    idx: [usize; 6],
    c2: usize,
}

impl Cnn {
    pub fn new(c1: usize, c2: usize, classes: usize, rng: &mut Rng) -> Result<Cnn> {
        let mut p = ParamSet::new();
        let f1 = 25;
        let f2 = c1 * 25;
        let flat = c2 * 7 * 7;
        let idx = [
            p.add("conv1.weight", &[c1, 1, 5, 5], uniform_fan_in(rng, c1 * 25, f1))?,
            p.add("conv1.bias", &[c1], uniform_fan_in(rng, c1, f1))?,
            p.add("conv2.weight", &[c2, c1, 5, 5], uniform_fan_in(rng, c2 * c1 * 25, f2))?,
            p.add("conv2.bias", &[c2], uniform_fan_in(rng, c2, f2))?,
            p.add("fc.weight", &[classes, flat], uniform_fan_in(rng, classes * flat, flat))?,
            p.add("fc.bias", &[classes], uniform_fan_in(rng, classes, flat))?,
        ];
        Ok(Cnn { params: p, idx, c2 })
    }
}

impl Model for Cnn {
    fn params(&self) -> &ParamSet {
        &self.params
    }

    fn forward(&self, input: &Input, view: &dyn ParamView) -> Result<Tensor> {
        let Input::Images { data, n, c, h, w } = input else {
            return Err(TensorError::Input("the CNN takes images".into()));
        };
        if (*c, *h, *w) != (1, 28, 28) {
            return Err(TensorError::Input(format!("the CNN takes 1x28x28 images, got {c}x{h}x{w}")));
        }
        let g = |i: usize| view.get(&self.params, self.idx[i]);
        let x = Tensor::from_slice(data, (*n, 1, 28, 28), &crate::device())?;
        let conv = |x: &Tensor, w: Tensor, b: Tensor| -> Result<Tensor> {
            // candle's CPU convolution has no half-precision kernel: it runs in f32.
            let dt = x.dtype();
            let y = x.to_dtype(candle_core::DType::F32)?.conv2d(&w.to_dtype(candle_core::DType::F32)?, 2, 1, 1, 1)?.to_dtype(dt)?;
            let c = b.dim(0)?;
            Ok(y.broadcast_add(&b.reshape((1, c, 1, 1))?)?.relu()?.max_pool2d(2)?)
        };
        let w0 = g(0)?;
        let x = conv(&x.to_dtype(w0.dtype())?, w0, g(1)?)?;
        let x = conv(&x, g(2)?, g(3)?)?;
        let x = x.reshape((*n, self.c2 * 7 * 7))?;
        linear(&x, &g(4)?, &g(5)?)
    }
}
