//! What a training run reports, whatever the strategy (issue #16: observability is the
//! driver's): the progress bar and log lines, the loss averaged over the ranks at each log step,
//! throughput, the straggler, Prometheus gauges (`train.metrics_port`), TensorBoard scalars
//! (`train.tensorboard_dir`) and JSON lines (`train.json_log`). A loop hands it each step's
//! measurements ([`Reporter::record`]) and calls [`Reporter::window`] on every rank at the same
//! steps ([`Reporter::is_log_step`]): the window's loss average and straggler exchange are
//! collectives.

use crate::config::TrainConfig;
use crate::summary::{peak_rss, Eval};
use crate::TrainError;
use kolo_comm::{BufMut, BufRef, Communicator, ReduceOp};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// One step's measurements; `None` where a step has nothing to report (no exchange).
#[derive(Clone, Copy, Debug, Default)]
pub struct StepRecord {
    /// The whole step, milliseconds.
    pub step_ms: f64,
    /// Waiting for other ranks (the exchange after backward), milliseconds.
    pub wait_ms: Option<f64>,
    /// Bytes this rank sent for gradients or models.
    pub comm_bytes: Option<usize>,
    /// Fraction of the exchange hidden behind backward.
    pub hidden: Option<f64>,
    /// Steps skipped so far (f16 overflow).
    pub skipped_steps: u64,
}

pub struct Reporter {
    global_rank: usize,
    lead: bool,
    steps: u64,
    log_every: u64,
    start: u64,
    global_batch: usize,
    tokens_per_example: usize,
    json: Option<std::fs::File>,
    tb: Option<crate::tensorboard::EventWriter>,
    metrics: Arc<crate::metrics::Metrics>,
    serve_metrics: bool,
    _endpoint: Option<crate::metrics::Server>,
    bar: Option<indicatif::ProgressBar>,
    window: Instant,
    pub step_ms: Vec<f64>,
    /// Per step: the step minus waiting for the others (this rank's own work).
    pub compute_ms: Vec<f64>,
    pub wait_ms: Vec<f64>,
    pub comm_bytes: Vec<usize>,
    pub hidden: Vec<f64>,
    pub last_loss: f64,
    pub straggler: Option<(usize, f64)>,
}

impl Reporter {
    /// The report of `[train]`'s settings: throughput counts `tokens_per_example` per example
    /// (1: samples/s; `Config::tokens_per_example` for `kolo train`'s models); `global_batch`:
    /// examples per optimizer step over all replicas; `start`: the first step (after a resume).
    /// Opens the JSON log, TensorBoard writer and metrics endpoint the settings ask for.
    pub fn for_train(
        tc: &TrainConfig,
        tokens_per_example: usize,
        global_rank: usize,
        quiet: bool,
        global_batch: usize,
        start: u64,
    ) -> Result<Reporter, TrainError> {
        let lead = global_rank == 0 && !quiet;
        let json = match &tc.json_log {
            Some(p) => {
                let path = p.replace("{rank}", &global_rank.to_string());
                if let Some(dir) = Path::new(&path).parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir).map_err(|e| TrainError::Other(format!("json_log {path}: {e}")))?;
                }
                Some(std::fs::File::create(&path).map_err(|e| TrainError::Other(format!("json_log {path}: {e}")))?)
            }
            None => None,
        };
        let tb = match &tc.tensorboard_dir {
            Some(d) => {
                let dir = Path::new(d).join(format!("rank{global_rank}"));
                Some(
                    crate::tensorboard::EventWriter::create(&dir)
                        .map_err(|e| TrainError::Config(format!("train.tensorboard_dir {}: {e}", dir.display())))?,
                )
            }
            None => None,
        };
        let metrics = crate::metrics::Metrics::new(global_rank);
        let endpoint = match tc.metrics_port {
            Some(port) => {
                let addr = format!("{}:{}", tc.metrics_addr, if port == 0 { 0 } else { port as usize + global_rank });
                let server = crate::metrics::serve(metrics.clone(), &addr)
                    .map_err(|e| TrainError::Config(format!("train.metrics_port: cannot listen on {addr}: {e}")))?;
                if !quiet {
                    kolo_base::eline!("rank {global_rank}: metrics on http://{}/metrics", server.addr);
                }
                Some(server)
            }
            None => None,
        };
        let bar = (lead && tc.progress && std::io::IsTerminal::is_terminal(&std::io::stderr())).then(|| {
            let pb = indicatif::ProgressBar::new(tc.steps);
            pb.set_style(
                indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps | {msg} | {elapsed_precise} ETA {eta}")
                    .expect("valid template"),
            );
            pb.set_position(start);
            pb
        });
        Ok(Reporter {
            global_rank,
            lead,
            steps: tc.steps,
            log_every: tc.log_every,
            start,
            global_batch,
            tokens_per_example,
            json,
            tb,
            metrics,
            serve_metrics: tc.metrics_port.is_some(),
            _endpoint: endpoint,
            bar,
            window: Instant::now(),
            step_ms: Vec::new(),
            compute_ms: Vec::new(),
            wait_ms: Vec::new(),
            comm_bytes: Vec::new(),
            hidden: Vec::new(),
            last_loss: f64::NAN,
            straggler: None,
        })
    }

    /// A line on the lead rank (through the progress bar when there is one).
    pub fn log(&self, m: &str) {
        match &self.bar {
            Some(pb) => pb.println(m),
            None if self.lead => kolo_base::eline!("{m}"),
            None => {}
        }
    }

    /// Records step `step` (0-based) and updates the gauges.
    pub fn record(&mut self, step: u64, r: StepRecord) {
        self.step_ms.push(r.step_ms);
        self.compute_ms.push(r.step_ms - r.wait_ms.unwrap_or(0.0));
        if let Some(w) = r.wait_ms {
            self.wait_ms.push(w);
        }
        if let Some(b) = r.comm_bytes {
            self.comm_bytes.push(b);
        }
        if let Some(h) = r.hidden {
            self.hidden.push(h);
        }
        if self.serve_metrics {
            let m = &self.metrics;
            m.step.set((step + 1) as f64);
            m.step_seconds.set(r.step_ms / 1e3);
            m.comm_bytes.inc_by(r.comm_bytes.unwrap_or(0) as f64);
            m.comm_wait_seconds.inc_by(r.wait_ms.unwrap_or(0.0) / 1e3);
            crate::metrics::Metrics::raise_to(&m.skipped_steps, r.skipped_steps as f64);
            m.heap_bytes.set(kolo_base::alloc::stats().map_or(0.0, |h| h.live as f64));
            m.peak_rss_bytes.set(peak_rss().unwrap_or(0) as f64);
        }
        if let Some(pb) = &self.bar {
            pb.set_position(step + 1);
        }
    }

    /// A straggler the strategy saw from outside the ranks' own timings
    /// ([`crate::driver::Strategy::straggler`]): `rank` trails the median by `lag` ms, `what`
    /// says how; named, like [`Reporter::window`]'s, when that is over 1 ms and 10 % of the
    /// window's step time.
    pub fn straggler_seen(&mut self, done: u64, rank: usize, lag: f64, what: &str) {
        let n = (self.log_every.max(1) as usize).min(self.step_ms.len());
        let ms = self.step_ms[self.step_ms.len() - n..].iter().sum::<f64>() / n.max(1) as f64;
        self.metrics.straggler_rank.set(rank as f64);
        self.metrics.straggler_lag_seconds.set(lag / 1e3);
        if lag > 1.0 && lag > 0.1 * ms {
            self.straggler = Some((rank, lag));
            self.log(&format!("step {done}: straggler: {what} (steps take {ms:.1} ms)"));
        }
    }

    /// Whether `done` steps end a log window (every `log_every` steps, and the last step).
    pub fn is_log_step(&self, done: u64, end: u64) -> bool {
        done.is_multiple_of(self.log_every.max(1)) || done == end
    }

    /// Ends a log window on every rank of `comm`: the loss averaged over them (`loss` is this
    /// rank's), throughput, the straggler (the rank whose own work per step is slowest, named
    /// when it is 10 % and 1 ms behind the median), the log line (with `extra` appended),
    /// TensorBoard and JSON.
    /// After [`Reporter::window`]: the error that stops a diverged run, when the loss averaged
    /// over the ranks is NaN or infinite (the same value on every rank, so every rank stops at
    /// the same step). f16's loss scaler skips such steps by itself.
    /// With `train.on_nonfinite = "skip"` the run goes on: its non-finite steps were skipped.
    pub fn diverged(&self, done: u64, tc: &crate::config::TrainConfig) -> Option<String> {
        let stops = tc.precision != crate::config::Precision::F16 && tc.on_nonfinite == crate::config::OnNonFinite::Stop;
        (!self.last_loss.is_finite() && stops).then(|| {
            format!(
                "step {done}: the loss averaged over the ranks is {}: the run diverged (lower optim.lr, set optim.clip_grad_norm, train in bf16, or skip such steps with train.on_nonfinite = \"skip\")",
                self.last_loss
            )
        })
    }

    pub fn window(&mut self, comm: &dyn Communicator, done: u64, loss: f64, lr: f32, epoch: u64, extra: &str) -> Result<(), TrainError> {
        let world = comm.world_size().get();
        let mut l = [loss];
        comm.all_reduce(BufMut::from(&mut l[..]), ReduceOp::Avg)?;
        self.last_loss = l[0];
        self.metrics.loss.set(self.last_loss);
        let every = self.log_every.max(1);
        let n = match (done - self.start) % every {
            0 => every,
            n => n,
        };
        let secs = self.window.elapsed().as_secs_f64();
        self.window = Instant::now();
        let sps = n as f64 * self.global_batch as f64 / secs;
        self.metrics.samples_per_second.set(sps);
        let recent = &self.step_ms[self.step_ms.len().saturating_sub(n as usize)..];
        let ms = recent.iter().sum::<f64>() / recent.len().max(1) as f64;
        let own = &self.compute_ms[self.compute_ms.len().saturating_sub(n as usize)..];
        // Each rank's own work and its rank in the job (`comm` may be a group of it: the
        // data-parallel ranks of a mesh), so the straggler is named as the job knows it.
        let mine = [own.iter().sum::<f64>() / own.len().max(1) as f64, self.global_rank as f64];
        let mut pairs = vec![0f64; 2 * world];
        comm.all_gather(BufRef::from(&mine[..]), BufMut::from(&mut pairs))?;
        let all: Vec<f64> = pairs.chunks(2).map(|p| p[0]).collect();
        if world > 1 {
            let (slow, max) = pairs.chunks(2).fold((0, f64::MIN), |a, p| if p[0] > a.1 { (p[1] as usize, p[0]) } else { a });
            let mut sorted = all.clone();
            sorted.sort_by(f64::total_cmp);
            // The lower median: with 2 ranks the slow one is compared with the other.
            let median = sorted[(world - 1) / 2];
            let lag = max - median;
            self.metrics.straggler_rank.set(slow as f64);
            self.metrics.straggler_lag_seconds.set(lag / 1e3);
            if lag > 0.1 * median && lag > 1.0 {
                self.straggler = Some((slow, lag));
                self.log(&format!(
                    "step {done}: straggler: rank {slow} computes {max:.1} ms/step, the median rank {median:.1} ms (+{lag:.1} ms)"
                ));
            }
        }
        let last_loss = self.last_loss;
        let msg = if self.tokens_per_example > 1 {
            format!("loss {last_loss:.4} | {:.0} tok/s | {ms:.1} ms/step{extra}", sps * self.tokens_per_example as f64)
        } else {
            format!("loss {last_loss:.4} | {sps:.0} samples/s | {ms:.1} ms/step{extra}")
        };
        match &self.bar {
            Some(pb) => pb.set_message(msg.clone()),
            None => self.log(&format!("step {done}/{} {msg}", self.steps)),
        }
        let (bytes, wait) = (self.comm_bytes.last().copied(), self.wait_ms.last().copied());
        self.scalars(
            &[
                ("train/loss", last_loss),
                ("train/lr", f64::from(lr)),
                ("train/step_ms", ms),
                ("train/samples_per_s", sps),
                ("comm/bytes_per_step", bytes.unwrap_or(0) as f64),
                ("comm/wait_ms", wait.unwrap_or(0.0)),
            ],
            done,
        );
        if let Some(f) = self.json.as_mut() {
            let rec = serde_json::json!({"rank": self.global_rank, "step": done, "loss": last_loss, "lr": lr, "step_ms": self.step_ms.last(),
                "comm_wait_ms": wait, "comm_bytes": bytes, "hidden_fraction": self.hidden.last(), "samples_per_s": sps, "epoch": epoch});
            let _ = writeln!(f, "{rec}");
        }
        Ok(())
    }

    /// TensorBoard scalars at `step` (non-finite values are left out).
    pub fn scalars(&mut self, items: &[(&str, f64)], step: u64) {
        if let Some(w) = self.tb.as_mut() {
            for (tag, v) in items {
                if v.is_finite() {
                    let _ = w.scalar(tag, step, *v as f32);
                }
            }
        }
    }

    /// An evaluation at `step`: TensorBoard, and a log line (`final`: the end-of-run one).
    pub fn eval(&mut self, step: u64, e: &Eval, last: bool) {
        self.scalars(&[("eval/loss", e.loss), ("eval/accuracy", e.accuracy.unwrap_or(f64::NAN))], step);
        let acc = e.accuracy.map_or(String::new(), |a| format!(", accuracy {:.2}%", a * 100.0));
        if last {
            if self.lead {
                kolo_base::eline!("final eval on {} examples: loss {:.4}{acc}", e.examples, e.loss);
            }
        } else {
            self.log(&format!("step {step}: eval loss {:.4}{acc}", e.loss));
        }
    }

    /// The mean hidden fraction of the exchange (1 when nothing was exchanged).
    pub fn hidden_fraction(&self) -> f64 {
        if self.hidden.is_empty() {
            1.0
        } else {
            self.hidden.iter().sum::<f64>() / self.hidden.len() as f64
        }
    }

    /// Closes the progress bar.
    pub fn finish(&self) {
        if let Some(pb) = &self.bar {
            pb.finish();
        }
    }
}
