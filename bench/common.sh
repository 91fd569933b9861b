# Sourced by the bench scripts: run from the repository root with a fresh release build of
# `kolo` in $K, one compute thread per rank, and $R repetitions (first argument, default 3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
R="${1:-3}"
cargo build --release -p kolo-cli >/dev/null
K=target/release/kolo
export RAYON_NUM_THREADS=1

# mnist_mlp FILE DATA_DIR LOG_EVERY [EXTRA_TOML]: the MNIST MLP 784-512-512-10 job of the training
# benchmarks (AdamW 1e-3, 2 x 64 per rank, 200 steps) into FILE, EXTRA_TOML appended.
mnist_mlp() {
  cat > "$1" <<TOML
[model]
kind = "mlp"
hidden = [512, 512]
[data]
kind = "mnist"
path = "$(realpath "$2")"
batch_size = 64
[optim]
kind = "adamw"
lr = 1e-3
[train]
steps = 200
log_every = $3
${4:-}
TOML
}
