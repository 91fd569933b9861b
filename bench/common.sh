# Sourced by the bench scripts: run from the repository root with a fresh release build of
# `kolo` in $K, one compute thread per rank, and $R repetitions (first argument, default 3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
R="${1:-3}"
cargo build --release -p kolo >/dev/null
K=target/release/kolo
export RAYON_NUM_THREADS=1
