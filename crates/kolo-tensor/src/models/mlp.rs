use super::{uniform_fan_in, Input, Model};
use crate::ops::linear;
use crate::{ParamSet, ParamView, Result, TensorError};
use candle_core::Tensor;
use kolo_base::Rng;

/// Fully connected ReLU network: input -> hidden... -> classes.
pub struct Mlp {
    params: ParamSet,
    layers: Vec<(usize, usize)>,
    input: usize,
}

impl Mlp {
    pub fn new(input: usize, hidden: &[usize], classes: usize, rng: &mut Rng) -> Result<Mlp> {
        let mut params = ParamSet::new();
        let mut layers = Vec::new();
        let mut fan_in = input;
        for (i, &out) in hidden.iter().chain(std::iter::once(&classes)).enumerate() {
            let w = params.add(&format!("fc{}.weight", i + 1), &[out, fan_in], uniform_fan_in(rng, out * fan_in, fan_in))?;
            let b = params.add(&format!("fc{}.bias", i + 1), &[out], uniform_fan_in(rng, out, fan_in))?;
            layers.push((w, b));
            fan_in = out;
        }
        Ok(Mlp { params, layers, input })
    }
}

impl Model for Mlp {
    fn params(&self) -> &ParamSet {
        &self.params
    }

    fn forward(&self, input: &Input, view: &dyn ParamView) -> Result<Tensor> {
        let Input::Images { data, n, c, h, w } = input else {
            return Err(TensorError::Input("the MLP takes images".into()));
        };
        if c * h * w != self.input {
            return Err(TensorError::Input(format!("the MLP takes {} features, got {}", self.input, c * h * w)));
        }
        let mut x = Tensor::from_slice(data, (*n, self.input), &crate::device())?;
        for (i, (wi, bi)) in self.layers.iter().enumerate() {
            let w = view.get(&self.params, *wi)?;
            if i == 0 {
                x = x.to_dtype(w.dtype())?; // the compute dtype of the view (mixed precision)
            }
            x = linear(&x, &w, &view.get(&self.params, *bi)?)?;
            if i + 1 < self.layers.len() {
                x = x.relu()?;
            }
        }
        Ok(x)
    }
}
