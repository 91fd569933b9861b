//! `kolo data prepare`: text files, directories and JSON lines to token shards.

use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub enum DataCmd {
    /// Tokenize text files, directories (walked) and JSON-lines files (one field), a 256 KiB
    /// piece at a time in parallel, into memory-mapped token shards (a 64-byte header, then u16
    /// or u32 ids) that training streams without loading them whole
    /// (`kolo::tokens::TokenShards`); manifest.json, written last, lists them with checksums.
    Prepare(PrepareArgs),
}

#[derive(clap::Args)]
pub struct PrepareArgs {
    /// Files and directories to read.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// Where the shards go (shard-00000.bin, ..., manifest.json); it must not hold shards of an
    /// earlier prepare.
    #[arg(short, long)]
    out: PathBuf,
    /// A Hugging Face tokenizer.json to tokenize with, or a model directory holding one.
    #[arg(long, conflicts_with = "train_bpe")]
    tokenizer: Option<PathBuf>,
    /// Instead: train a byte-level BPE of this many tokens on the inputs first (written to
    /// OUT/tokenizer.json).
    #[arg(long)]
    train_bpe: Option<usize>,
    /// Read `.jsonl` inputs as JSON lines and tokenize this string field of each.
    #[arg(long)]
    jsonl_field: Option<String>,
    /// Tokens per shard.
    #[arg(long, default_value_t = 100_000_000)]
    shard_tokens: usize,
}

pub fn run(cmd: DataCmd) -> anyhow::Result<i32> {
    let DataCmd::Prepare(a) = cmd;
    let sources = kolo::tokens::sources(&a.inputs, a.jsonl_field.as_deref())?;
    let tok = match (&a.tokenizer, a.train_bpe) {
        (Some(t), _) => kolo::tokens::Tok::load(t)?,
        (None, Some(v)) => {
            let files: Vec<PathBuf> = sources
                .iter()
                .map(|s| match s {
                    kolo::tokens::Source::Text(p) => Ok(p.clone()),
                    kolo::tokens::Source::JsonLines { path, .. } => {
                        anyhow::bail!("{}: train the BPE on text files (--train-bpe does not read JSON lines)", path.display())
                    }
                })
                .collect::<anyhow::Result<_>>()?;
            let t = kolo::tokens::train_bpe(&files, v, &a.out.join("tokenizer.json"))?;
            kolo_base::eline!("trained a byte-level BPE of {} tokens: {}", t.vocab_size(), a.out.join("tokenizer.json").display());
            t
        }
        (None, None) => anyhow::bail!("give --tokenizer tokenizer.json, or --train-bpe VOCAB_SIZE"),
    };
    let bar = indicatif::ProgressBar::new(sources.len() as u64);
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let t0 = std::time::Instant::now();
    let p = kolo::tokens::prepare(&tok, &sources, &a.out, a.shard_tokens, &|done| bar.set_position(done as u64))?;
    bar.finish_and_clear();
    println!(
        "{} documents from {} files -> {} tokens in {} shards under {} ({:.1} s, vocabulary {})",
        p.documents,
        sources.len(),
        p.tokens,
        p.shards.len(),
        a.out.display(),
        t0.elapsed().as_secs_f64(),
        tok.vocab_size()
    );
    Ok(0)
}
