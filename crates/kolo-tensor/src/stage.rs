//! A pipeline stage of the GPT: a contiguous range of its layers run micro-batch by
//! micro-batch. Activations and gradients cross the stage boundary as flat f32 buffers (the
//! pipeline executor sends them); inside, the stage keeps each micro-batch's graph from its
//! forward until its backward.

use crate::models::{Batch, Gpt, Input, StageInput};
use crate::{Model, PlainView, Result, TensorError};
use candle_core::{Device, Tensor, Var};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

/// The stage holds its model (weights) by `Arc`: PipeDream-2BW runs each batch on its own
/// weight version, which stays alive until the batch's last backward.
pub struct GptStage {
    gpt: Arc<Gpt>,
    layers: Range<usize>,
    params: Vec<usize>,
    micro: Vec<Batch>,
    /// Each micro-batch's loss is scaled by 1 / micro-batches, so the gradients add up to the
    /// gradient of the whole batch's mean loss.
    scale: f64,
    saved: HashMap<usize, Saved>,
    /// Re-materialization: keep only each micro-batch's input between its forward and
    /// backward, and run the forward again (with a graph) in backward.
    remat: bool,
    /// This stage's parameters' gradients, accumulated over the micro-batches (flat layout of
    /// the whole model; other stages' entries stay zero).
    pub grads: Vec<f32>,
}

impl GptStage {
    pub fn new(gpt: Arc<Gpt>, layers: Range<usize>, micro: Vec<Batch>) -> GptStage {
        let params = layers.clone().flat_map(|l| gpt.layer_params(l)).collect();
        let scale = 1.0 / micro.len().max(1) as f64;
        let grads = vec![0f32; gpt.params().numel()];
        GptStage { gpt, layers, params, micro, scale, saved: HashMap::new(), grads, remat: false }
    }

    /// Keep only the stage's boundary activation (its input) per micro-batch and recompute the
    /// rest in backward (GPipe's re-materialization): less memory for one more forward.
    pub fn rematerialize(mut self, on: bool) -> GptStage {
        self.remat = on;
        self
    }

    /// The parameters this stage owns (indices into the model's `ParamSet`).
    pub fn params(&self) -> &[usize] {
        &self.params
    }

    fn is_last(&self) -> bool {
        self.layers.end == self.gpt.layers()
    }

    fn shape(&self, mb: usize) -> Result<(usize, usize)> {
        match &self.micro.get(mb).ok_or_else(|| TensorError::Input(format!("no micro-batch {mb}")))?.input {
            Input::Tokens { b, t, .. } => Ok((*b, *t)),
            Input::Images { .. } => Err(TensorError::Input("a GPT stage takes token sequences".into())),
        }
    }

    /// Values crossing a stage boundary per micro-batch (hidden states).
    pub fn act_len(&self) -> Result<usize> {
        let (b, t) = self.shape(0)?;
        Ok(b * t * self.gpt.config().d_model)
    }

    /// Forward of micro-batch `mb` from `input` (the previous stage's hidden states; `None` on
    /// the first stage). Returns the hidden states, or on the last stage the scaled loss.
    pub fn forward(&mut self, mb: usize, input: Option<Vec<f32>>) -> Result<Vec<f32>> {
        if self.remat {
            // Run without keeping anything but the input; the graph dies with `out`.
            let (var, out) = self.run(mb, input.clone())?;
            drop(var);
            self.saved.insert(mb, Saved::Input(input));
            return self.output_values(out);
        }
        let (var, out) = self.run(mb, input)?;
        let values = self.output_values(out.clone())?;
        self.saved.insert(mb, Saved::Graph(var, out));
        Ok(values)
    }

    /// The stage's output values: hidden states, or the last stage's scaled loss.
    fn output_values(&self, out: Tensor) -> Result<Vec<f32>> {
        if self.is_last() {
            Ok(vec![out.to_scalar::<f32>()?])
        } else {
            Ok(out.flatten_all()?.to_vec1::<f32>()?)
        }
    }

    /// The stage's layers on micro-batch `mb` with a graph: the input variable (not on the first
    /// stage) and the output (the scaled loss on the last stage).
    fn run(&self, mb: usize, input: Option<Vec<f32>>) -> Result<(Option<Var>, Tensor)> {
        let (b, t) = self.shape(mb)?;
        let c = self.gpt.config().d_model;
        let (var, x) = match input {
            None => {
                let Input::Tokens { ids, .. } = &self.micro[mb].input else { unreachable!("checked by shape") };
                (None, StageInput::Tokens { ids, b, t })
            }
            Some(v) => {
                let var = Var::from_vec(v, (b, t, c), &Device::Cpu)?;
                let h = var.as_tensor().clone();
                (Some(var), StageInput::Hidden(h))
            }
        };
        let out = self.gpt.forward_layers(x, self.layers.clone(), &PlainView)?;
        if self.is_last() {
            Ok((var, (self.gpt.logits_loss(&out, &self.micro[mb].targets)? * self.scale)?))
        } else {
            Ok((var, out))
        }
    }

    /// Backward of micro-batch `mb` given the gradient of its output (`None` on the last
    /// stage). Accumulates the parameter gradients; returns the gradient of the input hidden
    /// states (empty on the first stage).
    pub fn backward(&mut self, mb: usize, grad: Option<Vec<f32>>) -> Result<Vec<f32>> {
        let (var, out) =
            match self.saved.remove(&mb).ok_or_else(|| TensorError::Input(format!("backward of micro-batch {mb} before its forward")))? {
                Saved::Graph(var, out) => (var, out),
                Saved::Input(input) => self.run(mb, input)?,
            };
        let store = match grad {
            None => out.backward()?,
            Some(g) => {
                let g = Tensor::from_vec(g, out.shape(), &Device::Cpu)?;
                (out * g)?.sum_all()?.backward()?
            }
        };
        self.gpt.params().add_grads(&store, &self.params, &mut self.grads)?;
        match var {
            None => Ok(Vec::new()),
            Some(v) => {
                let g = store.get(v.as_tensor()).ok_or_else(|| TensorError::MissingGrad { name: "stage input".into() })?;
                Ok(g.flatten_all()?.to_vec1::<f32>()?)
            }
        }
    }
}

/// What a stage keeps of a micro-batch between its forward and its backward.
enum Saved {
    /// The whole graph: the input variable and the output.
    Graph(Option<Var>, Tensor),
    /// Re-materialization: the input only.
    Input(Option<Vec<f32>>),
}
