//! [`TrainOptions`]: what the [`Trainer`](crate::Trainer) does, in the keys of `kolo train`'s
//! config file (one TOML file serves both), with a typed setter for each setting; and the
//! types of its tables.

use crate::{Error, Result};
use std::path::Path;
use std::sync::Arc;

pub use kolo_train::config::{
    CompressionConfig, CompressionMethod, Config, DdpConfig, LocalSgdConfig, MeshConfig, OptimConfig, OptimKind, ParamGroupConfig,
    PipeSchedule, PipelineConfig, Precision, PsConfig, PsConsistency, ScheduleKind, Strategy, TrainConfig,
};

/// What the trainer does, in the keys of `kolo train`'s config file (`[optim]`, `[ddp]`,
/// `[train]` and `[data]`'s `batch_size`), so one TOML file serves both.
#[derive(Clone, Debug, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainOptions {
    /// Optimizer, learning rate and its schedule, weight decay, gradient clipping, offload.
    pub optim: OptimConfig,
    /// Buckets, deadline, ZeRO stage (0, 1 or 2) and gradient compression.
    pub ddp: DdpConfig,
    /// Steps, gradient accumulation, logging (`log_every`, `progress`, `json_log`,
    /// `tensorboard_dir`, `metrics_port`, `timeline_dir`), checkpoints (`checkpoint_dir`,
    /// `checkpoint_every`, `checkpoint_background`), the evaluation cadence (`eval_every`:
    /// [`Trainer::eval_due`](crate::Trainer::eval_due)) and the data order's `seed` ([`Trainer::sampler`](crate::Trainer::sampler)).
    pub train: TrainConfig,
    /// What a micro-batch holds, for throughput in the logs.
    pub data: DataOptions,
    /// A parameter-server job's servers, consistency and key ranges (`strategy = "ps"`,
    /// trained by [`crate::PsWorker`]).
    pub ps: kolo_train::config::PsConfig,
    /// A rule of the user's own instead of `optim.kind` ([`TrainOptions::update_rule`]; code,
    /// so not part of the TOML).
    #[serde(skip)]
    pub rule: Option<kolo_optim::Custom>,
}

/// The `[data]` table of [`TrainOptions`]: the trainer does not see the batches, so the
/// throughput it logs counts what this says; [`Trainer::sampler`](crate::Trainer::sampler) deals them as it says.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataOptions {
    /// Examples per rank and micro-step (0: unknown; throughput is then not logged).
    pub batch_size: usize,
    /// Tokens per example (sequence models: the sequence length); 1 logs samples/s.
    pub tokens_per_example: usize,
    /// [`Trainer::sampler`](crate::Trainer::sampler): reshuffle every epoch from `train.seed` (default true).
    pub shuffle: bool,
    /// [`Trainer::sampler`](crate::Trainer::sampler): drop each epoch's last incomplete batch (default true).
    pub drop_last: bool,
}

impl Default for DataOptions {
    fn default() -> Self {
        DataOptions { batch_size: 0, tokens_per_example: 1, shuffle: true, drop_last: true }
    }
}

impl TrainOptions {
    /// The defaults (AdamW at 1e-3, plain DDP, no clipping), to refine with the methods below:
    /// `TrainOptions::new().optimizer(OptimKind::Sgd, 0.1).zero_stage(2).steps(100)`. Every
    /// field is also public, and [`TrainOptions::from_toml`] reads the same settings from the
    /// tables of `kolo train`'s config. The trainer checks them when it is built.
    pub fn new() -> TrainOptions {
        TrainOptions::default()
    }

    /// The optimizer (`[optim] kind`) and its base learning rate.
    pub fn optimizer(mut self, kind: crate::options::OptimKind, lr: f32) -> Self {
        (self.optim.kind, self.optim.lr) = (kind, lr);
        self
    }

    /// The base learning rate (`[optim] lr`), keeping the optimizer.
    pub fn lr(mut self, lr: f32) -> Self {
        self.optim.lr = lr;
        self
    }

    /// Trains with an optimizer of your own ([`UpdateRule`](crate::UpdateRule): an element-wise
    /// rule over flat buffers) instead of `optim.kind`. The learning rate (`optim.lr`) and its schedule,
    /// weight decay, parameter groups, clipping, ZeRO sharding of its state and checkpoints
    /// apply to it as to Kolo's optimizers.
    pub fn update_rule(mut self, rule: impl crate::UpdateRule + 'static) -> Self {
        self.rule = Some(kolo_optim::Custom(Arc::new(rule)));
        self
    }

    /// The optimizer these options train with.
    pub(crate) fn optimizer_spec(&self) -> kolo_optim::OptimizerSpec {
        match &self.rule {
            Some(rule) => kolo_optim::OptimizerSpec::Custom { rule: rule.clone(), weight_decay: self.optim.weight_decay },
            None => self.optim.spec(),
        }
    }

    /// Weight decay for parameters of two or more dimensions (biases and norm scales stay
    /// undecayed unless `optim.decay_1d`).
    pub fn weight_decay(mut self, wd: f32) -> Self {
        self.optim.weight_decay = wd;
        self
    }

    /// A parameter group (torch's `param_groups`): parameters whose name contains one of
    /// `patterns` (the first group that matches wins) get this weight decay (`None`: the
    /// default one) and this factor on the learning rate.
    pub fn param_group(mut self, patterns: &[&str], weight_decay: Option<f32>, lr_scale: f32) -> Self {
        let patterns = patterns.iter().map(|p| p.to_string()).collect();
        self.optim.groups.push(crate::options::ParamGroupConfig { patterns, weight_decay, lr_scale });
        self
    }

    /// Clips gradients to this global L2 norm.
    pub fn clip_grad_norm(mut self, max_norm: f64) -> Self {
        self.optim.clip_grad_norm = Some(max_norm);
        self
    }

    /// Linear warm-up over `warmup_steps`, then the schedule (`[optim] schedule`).
    pub fn schedule(mut self, schedule: crate::options::ScheduleKind, warmup_steps: u64) -> Self {
        (self.optim.schedule, self.optim.warmup_steps) = (schedule, warmup_steps);
        self
    }

    /// Scheduled communication (`[ddp] schedule`, ByteScheduler): the gradients go in chunks of
    /// `chunk` bytes ("256KiB"), up to `credit` bytes ("1MiB") per collective, first layers
    /// first, and each parameter is updated as soon as its own are reduced, under the next
    /// forward pass. Plain f32 DDP on the CPU (no clipping, accumulation, ZeRO or mesh).
    pub fn scheduled_comm(mut self, chunk: &str, credit: &str) -> Self {
        self.ddp.schedule = Some(kolo_train::config::ScheduleConfig { chunk: chunk.into(), credit: credit.into() });
        self
    }

    /// DDP's gradient buckets: `cap` bytes each ("25MiB"), the first one (the last layers',
    /// reduced while backward is still early) `first_cap` ("1MiB").
    pub fn buckets(mut self, cap: &str, first_cap: &str) -> Self {
        (self.ddp.bucket_cap, self.ddp.first_bucket_cap) = (cap.into(), first_cap.into());
        self
    }

    /// The communicator's deadlines: a collective waits at most `timeout_secs`, and a peer
    /// silent for `liveness_secs` (0: no heartbeats) is declared dead. Start the communicator
    /// with them: `kolo::init_with(&opts.init_options())`.
    pub fn deadlines(mut self, timeout_secs: f64, liveness_secs: f64) -> Self {
        (self.ddp.timeout_secs, self.ddp.liveness_secs) = (timeout_secs, liveness_secs);
        self
    }

    /// Gradient compression of the all-reduce (`[ddp] compression`), e.g.
    /// `CompressionConfig { rank: 4, ..CompressionConfig::new(CompressionMethod::Powersgd) }`.
    pub fn compression(mut self, c: crate::options::CompressionConfig) -> Self {
        self.ddp.compression = Some(c);
        self
    }

    /// Local SGD: past `warmup_steps` of DDP each replica steps on its own gradient and the
    /// models are averaged every `every` steps.
    pub fn local_sgd(mut self, every: u64, warmup_steps: u64) -> Self {
        self.ddp.local_sgd = Some(crate::options::LocalSgdConfig { every, warmup_steps });
        self
    }

    /// Deterministic mode: bitwise the same parameters at any world size for the same global
    /// batch, each micro-batch summed in pieces of `chunk` examples ([`Trainer::step_pieces`](crate::Trainer::step_pieces)).
    pub fn deterministic(mut self, chunk: usize) -> Self {
        (self.ddp.deterministic, self.ddp.deterministic_chunk) = (true, chunk);
        self
    }

    /// Dynamic batch sizing: every `every` steps the global batch is split anew by the ranks'
    /// measured speed ([`Trainer::sampler`](crate::Trainer::sampler) deals each rank its share).
    pub fn dynamic_batches(mut self, every: u64) -> Self {
        self.ddp.dynamic_batch_every = every;
        self
    }

    /// Every collective of the data-parallel group fingerprinted and compared across its ranks
    /// first: a rank calling another collective, size or dtype fails naming both.
    pub fn check_collectives(mut self) -> Self {
        self.ddp.check_collectives = true;
        self
    }

    /// TensorBoard event files under `dir` (a run per rank) and JSON lines to `json_log`
    /// (`{rank}` replaced), as `kolo train` writes them; `None` leaves either off.
    pub fn logs(mut self, tensorboard_dir: Option<&str>, json_log: Option<&str>) -> Self {
        self.train.tensorboard_dir = tensorboard_dir.map(str::to_string);
        self.train.json_log = json_log.map(str::to_string);
        self
    }

    /// Text sampling ([`Trainer::sample`](crate::Trainer::sample)): `tokens` tokens at `temperature`.
    pub fn sampling(mut self, tokens: usize, temperature: f32) -> Self {
        (self.train.sample_chars, self.train.sample_temperature) = (tokens, temperature);
        self
    }

    /// ZeRO stage: 0 (DDP), 1, 2 or 3 (the groups of [`Trainer::with_zero3_groups`](crate::Trainer::with_zero3_groups)).
    pub fn zero_stage(mut self, stage: u8) -> Self {
        self.ddp.zero_stage = stage;
        self
    }

    /// Optimizer steps in the run (the schedule's length, and when the last checkpoint is
    /// written).
    pub fn steps(mut self, steps: u64) -> Self {
        self.train.steps = steps;
        self
    }

    /// Micro-steps per optimizer step (gradient accumulation).
    pub fn grad_accum(mut self, micro_steps: u64) -> Self {
        self.train.grad_accum = micro_steps;
        self
    }

    /// Mixed precision: the dtype the model is built in (f32 masters).
    pub fn precision(mut self, precision: crate::options::Precision) -> Self {
        self.train.precision = precision;
        self
    }

    /// The device the model is on (`[train] device`): `cpu` (the default), `cuda` (each rank's
    /// GPU, chosen by `Dist::use_device`) or `cuda:N`. The trainer checks that every parameter
    /// is there.
    pub fn device(mut self, name: impl Into<String>) -> Self {
        self.train.device = name.into();
        self
    }

    /// A log line every `every` steps (0: none).
    pub fn log_every(mut self, every: u64) -> Self {
        self.train.log_every = every;
        self
    }

    /// A checkpoint in `dir` every `every` steps and at the end.
    pub fn checkpoints(mut self, dir: impl Into<String>, every: u64) -> Self {
        (self.train.checkpoint_dir, self.train.checkpoint_every) = (Some(dir.into()), every);
        self
    }

    /// Examples per rank and micro-step, and tokens per example (1 for non-sequence models):
    /// the throughput in the logs, the global batch of `optim.reference_batch`, and the batch
    /// [`Trainer::sampler`](crate::Trainer::sampler) draws.
    pub fn batch(mut self, batch_size: usize, tokens_per_example: usize) -> Self {
        (self.data.batch_size, self.data.tokens_per_example) = (batch_size, tokens_per_example);
        self
    }

    /// `train.strategy`: `Ddp` (the [`Trainer`](crate::Trainer)) or `Ps` (parameter servers, [`crate::PsWorker`],
    /// with the `[ps]` table's settings).
    pub fn strategy(mut self, strategy: crate::options::Strategy) -> Self {
        self.train.strategy = strategy;
        self
    }

    /// The data order's seed (`train.seed`): [`Trainer::sampler`](crate::Trainer::sampler) shuffles every epoch from it.
    pub fn seed(mut self, seed: u64) -> Self {
        self.train.seed = seed;
        self
    }

    /// An evaluation every `every` steps and after the last ([`Trainer::eval_due`](crate::Trainer::eval_due); 0: only
    /// after the last).
    pub fn eval_every(mut self, every: u64) -> Self {
        self.train.eval_every = every;
        self
    }

    /// How to start this job's communicator so that it has `[ddp]`'s deadlines
    /// (`timeout_secs` for every collective, `liveness_secs` for a stalled peer's heartbeats),
    /// as `kolo train` starts it: `kolo::init_with(&opts.init_options())`. The trainer checks
    /// that its communicator has them.
    pub fn init_options(&self) -> crate::InitOptions {
        let comm = kolo_collectives::HostCommConfig {
            timeout: crate::dist::timeout_of(self.ddp.timeout_secs),
            liveness: crate::dist::seconds(self.ddp.liveness_secs),
            ..Default::default()
        };
        crate::InitOptions { comm, ..Default::default() }
    }

    /// Reads the options from a TOML file (unknown keys are an error).
    pub fn from_toml(path: impl AsRef<Path>) -> Result<TrainOptions> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_toml_str(&text).map_err(|e| match e {
            Error::File { reason, .. } => Error::file(path, reason),
            e => e,
        })
    }

    /// The trainer's tables of a `kolo train` config file (`[optim]`, `[ddp]`, `[train]`, `[ps]`
    /// and `[data]`'s `batch_size`, `shuffle` and `drop_last`), so one file configures both; its `[model]` and the rest of
    /// `[data]` describe Kolo's built-in models and datasets, which your program replaces.
    /// Checked as [`TrainOptions::from_toml`] is.
    pub fn from_train_config(cfg: &kolo_train::Config) -> Result<TrainOptions> {
        Self::of_tables((&cfg.optim, &cfg.ddp, &cfg.train), &cfg.data, &cfg.ps)
    }

    /// The trainer's tables of a `kolo train` config resolved for its job (`kolo::builtin`'s
    /// strategies), as [`TrainOptions::from_train_config`] takes them.
    pub(crate) fn from_setup(setup: &kolo_train::setup::Setup) -> Result<TrainOptions> {
        Self::of_tables((&setup.optim, &setup.ddp, &setup.train), &setup.data, &setup.ps)
    }

    fn of_tables(
        (optim, ddp, train): (&OptimConfig, &DdpConfig, &TrainConfig),
        data: &kolo_train::config::DataConfig,
        ps: &kolo_train::config::PsConfig,
    ) -> Result<TrainOptions> {
        let o = TrainOptions {
            optim: optim.clone(),
            ddp: ddp.clone(),
            train: train.clone(),
            data: DataOptions { batch_size: data.batch_size, shuffle: data.shuffle, drop_last: data.drop_last, ..DataOptions::default() },
            ps: ps.clone(),
            rule: None,
        };
        o.check()?;
        Ok(o)
    }

    /// Parses the options from TOML text.
    pub fn from_toml_str(text: &str) -> Result<TrainOptions> {
        let o: TrainOptions = toml::from_str(text).map_err(|e| Error::file("<options>", e))?;
        o.check()?;
        Ok(o)
    }

    /// Refuses the settings the trainer cannot honour, naming them ([`Error::Setting`]): first
    /// those only `kolo train` can run (it owns the batch, the model or the communicator), then
    /// the tables' own rules, checked by the same code and with the same messages as `kolo
    /// train`'s.
    pub fn check(&self) -> Result<()> {
        let only_kolo_train = [(
            self.optim.reference_batch.is_some() && self.data.batch_size == 0,
            "optim.reference_batch",
            " without [data] batch_size (the global batch it scales by is batch_size x ranks x grad_accum)",
        )];
        if let Some((_, setting, why)) = only_kolo_train.iter().find(|(bad, _, _)| *bad) {
            return Err(Error::setting(*setting, format!("kolo::Trainer does not support {setting}{why}")));
        }
        self.as_train_config()?.check().map_err(|e| {
            let text = e.to_string();
            let reason = text.strip_prefix("config error: ").unwrap_or(&text).to_string();
            let setting: String = reason.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '.').collect();
            Error::setting(if setting.contains('.') { setting } else { "options".into() }, reason)
        })
    }

    /// These options as a `kolo train` config of a stand-in model and data, for its checks
    /// (`train.steps` may be 0 here: the loop is the caller's). The data is real (a user's),
    /// not kolo train's per-rank synthetic data.
    pub(crate) fn as_train_config(&self) -> Result<kolo_train::Config> {
        let mut cfg = kolo_train::Config::parse(
            "[model]\nkind = \"gpt\"\n[data]\nkind = \"text\"\npath = \"(the user's)\"\nbatch_size = 1\n",
            "kolo::TrainOptions",
        )?;
        cfg.optim = self.optim.clone();
        cfg.ddp = self.ddp.clone();
        cfg.ps = self.ps.clone();
        cfg.train = self.train.clone();
        cfg.train.steps = cfg.train.steps.max(1);
        cfg.data.batch_size = self.data.batch_size.max(1);
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::TrainOptions;

    /// The builder sets what the same TOML sets.
    #[test]
    fn the_builder_equals_the_toml() {
        use crate::options::{OptimKind, Precision, ScheduleKind};
        let built = TrainOptions::new()
            .optimizer(OptimKind::Sgd, 0.1)
            .weight_decay(0.01)
            .param_group(&["embed"], Some(0.0), 0.5)
            .clip_grad_norm(1.0)
            .schedule(ScheduleKind::Cosine, 10)
            .zero_stage(2)
            .steps(100)
            .grad_accum(2)
            .precision(Precision::Bf16)
            .log_every(5)
            .checkpoints("ck", 50)
            .batch(8, 64);
        let toml = "[optim]\nkind = \"sgd\"\nlr = 0.1\nweight_decay = 0.01\ngroups = [{ match = [\"embed\"], weight_decay = 0.0, lr_scale = 0.5 }]\nclip_grad_norm = 1.0\nschedule = \"cosine\"\nwarmup_steps = 10\n[ddp]\nzero_stage = 2\n[train]\nsteps = 100\ngrad_accum = 2\nprecision = \"bf16\"\nlog_every = 5\ncheckpoint_dir = \"ck\"\ncheckpoint_every = 50\n[data]\nbatch_size = 8\ntokens_per_example = 64\n";
        let parsed = TrainOptions::from_toml_str(toml).unwrap();
        assert_eq!(toml::to_string(&built).unwrap(), toml::to_string(&parsed).unwrap());
        built.check().unwrap();
        // The rest of [ddp] and [train], in combinations each valid on its own.
        use crate::options::{CompressionConfig, CompressionMethod};
        let powersgd = CompressionConfig { rank: 4, ..CompressionConfig::new(CompressionMethod::Powersgd) };
        for (built, toml) in [
            (TrainOptions::new().scheduled_comm("64KiB", "256KiB"), "[ddp]\nschedule = { chunk = \"64KiB\", credit = \"256KiB\" }\n"),
            (
                TrainOptions::new().buckets("4MiB", "512KiB").deadlines(60.0, 5.0).compression(powersgd).check_collectives(),
                "[ddp]\nbucket_cap = \"4MiB\"\nfirst_bucket_cap = \"512KiB\"\ntimeout_secs = 60\nliveness_secs = 5\ncheck_collectives = true\ncompression = { method = \"powersgd\", rank = 4 }\n",
            ),
            (TrainOptions::new().local_sgd(4, 10), "[ddp]\nlocal_sgd = { every = 4, warmup_steps = 10 }\n"),
            (
                TrainOptions::new().batch(12, 1).deterministic(4),
                "[ddp]\ndeterministic = true\ndeterministic_chunk = 4\n[data]\nbatch_size = 12\ntokens_per_example = 1\n",
            ),
            (TrainOptions::new().batch(12, 1).dynamic_batches(20), "[ddp]\ndynamic_batch_every = 20\n[data]\nbatch_size = 12\ntokens_per_example = 1\n"),
            (
                TrainOptions::new().logs(Some("tb"), Some("log-{rank}.jsonl")).sampling(60, 0.5),
                "[train]\ntensorboard_dir = \"tb\"\njson_log = \"log-{rank}.jsonl\"\nsample_chars = 60\nsample_temperature = 0.5\n",
            ),
        ] {
            let parsed = TrainOptions::from_toml_str(toml).unwrap();
            assert_eq!(toml::to_string(&built).unwrap(), toml::to_string(&parsed).unwrap(), "{toml}");
            built.check().unwrap();
        }
    }

    /// A setting both `kolo train` and the library refuse is refused with the same message: the
    /// library's check is `kolo train`'s for the tables they share.
    #[test]
    fn settings_both_refuse_have_one_message() {
        let cli = |tables: &str| {
            let text = format!("[model]\nkind = \"gpt\"\n[data]\nkind = \"synthetic\"\nbatch_size = 4\n{tables}");
            kolo_train::Config::parse(&text, "test").unwrap_err().to_string()
        };
        for tables in [
            "[ddp]\nzero_stage = 3\ncompression = { method = \"topk\", fraction = 0.1 }\n",
            "[ddp]\nzero_stage = 1\nlocal_sgd = { every = 4 }\n",
            "[train]\nprecision = \"f16\"\n[ddp]\nlocal_sgd = { every = 4 }\n",
            "[ddp]\nzero_stage = 4\n",
            "[optim]\nlr = -1\n",
            "[optim]\nbeta2 = 1.0\n",
            "[optim]\ngroups = [{ match = [] }]\n",
            "[ddp]\nbucket_cap = \"lots\"\n",
        ] {
            let lib = match TrainOptions::from_toml_str(tables) {
                Err(crate::Error::Setting { reason, .. }) => reason,
                other => panic!("{tables}: the library did not refuse it: {other:?}"),
            };
            let cli = cli(tables);
            assert!(cli.ends_with(&lib), "{tables}: kolo train says {cli:?}, the library {lib:?}");
        }
    }

    #[test]
    fn unsupported_settings_are_named() {
        // ZeRO-3 accumulates (FSDP's no_sync), in the library as in kolo train.
        assert!(TrainOptions::from_toml_str("[ddp]\nzero_stage = 3\n[train]\ngrad_accum = 2\n").is_ok());
        let e = TrainOptions::from_toml_str("[optim]\nlearning_rate = 1\n").unwrap_err().to_string();
        assert!(e.contains("learning_rate"), "{e}");
        let e = TrainOptions::from_toml_str("[train]\nprecision = \"f16\"\n[ddp]\nlocal_sgd = { every = 4 }\n").unwrap_err().to_string();
        assert!(e.contains("train.precision = \"f16\" (loss scaling) does not combine with ddp.local_sgd"), "{e}");
        let o = TrainOptions::from_toml_str("[optim]\nkind = \"sgd\"\nlr = 0.1\n[train]\ngrad_accum = 2\n").unwrap();
        assert_eq!((o.optim.lr, o.train.grad_accum), (0.1, 2));
        let e = TrainOptions::from_toml_str("[ddp]\nzero_stage = 1\nlocal_sgd = { every = 4 }\n").unwrap_err().to_string();
        assert!(e.contains("ddp.local_sgd needs every >= 1, ddp.zero_stage = 0 and no ddp.compression"), "{e}");
        assert!(TrainOptions::from_toml_str("[ddp]\nlocal_sgd = { every = 4 }\n").is_ok());
        // Scheduled communication runs from the library, within kolo train's own limits.
        assert!(TrainOptions::from_toml_str("[ddp]\nschedule = { chunk = \"4KiB\" }\n").is_ok());
        let e = TrainOptions::from_toml_str("[optim]\nclip_grad_norm = 1.0\n[ddp]\nschedule = {}\n").unwrap_err().to_string();
        assert!(e.contains("ddp.schedule runs plain f32 DDP on the CPU"), "{e}");
        // The communicator's deadlines are options (checked against the communicator's).
        assert!(TrainOptions::from_toml_str("[ddp]\nliveness_secs = 3\ntimeout_secs = 20\n").is_ok());
        // The setting is a field of the error, for callers that match on it.
        for (toml, want) in [
            ("[ddp]\nzero_stage = 4\n", "ddp.zero_stage"),
            ("[ddp]\nliveness_secs = -1\n", "ddp.liveness_secs"),
            ("[optim]\nlr = -1\n", "optim.lr"),
            ("[ddp]\nbucket_cap = \"lots\"\n", "ddp.bucket_cap"),
        ] {
            match TrainOptions::from_toml_str(toml) {
                Err(crate::Error::Setting { setting, reason }) => {
                    assert_eq!(setting, want, "{toml}");
                    assert!(!reason.starts_with(&format!("{want}: ")), "the setting is not repeated at the start: {reason}");
                }
                other => panic!("{toml}: expected Error::Setting, got {other:?}"),
            }
        }
    }
}
