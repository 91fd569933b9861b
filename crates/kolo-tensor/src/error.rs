#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("parameter `{name}` received no gradient (an op dropped it, or the parameter is unused)")]
    MissingGrad { name: String },
    #[error("parameter `{name}`: {what}")]
    Shape { name: String, what: String },
    #[error("bad input: {0}")]
    Input(String),
}
