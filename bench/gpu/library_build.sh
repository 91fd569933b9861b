#!/usr/bin/env bash
# Builds what bench/gpu/library_run.sh needs into .gpu-lib/ (git-ignored), on this machine: the
# GPU tests of a user's model through kolo::Trainer (crates/kolo/tests/cuda.rs), the user_mlp
# example with candle's CUDA backend, and a plain `kolo` for `kolo launch`. Needs nvcc 13
# (bench/gpu/cuda-toolkit.sh makes one); the tests read only the repository's test-data.
set -euo pipefail
CUDA=${CUDA_HOME:-/tmp/cuda13}
T=${CUDA_TARGET_DIR:-target/cuda}
[ -x "$CUDA/bin/nvcc" ] || bash bench/gpu/cuda-toolkit.sh "$CUDA"
export PATH=$CUDA/bin:$PATH CUDA_HOME=$CUDA CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
F=cuda,hf,nccl
TEST=$(cargo test --release -p kolo --features $F --test cuda --no-run --target-dir "$T" --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and m["target"]["name"] == "cuda"][-1])')
cargo build --release -p kolo --features $F --example user_mlp --target-dir "$T"
env -u CUDA_HOME PATH=${PATH#"$CUDA/bin:"} cargo build --release -p kolo-cli
D=.gpu-lib
mkdir -p $D
grep -qx "/$D/" .git/info/exclude 2>/dev/null || echo "/$D/" >> .git/info/exclude
# xz: the CUDA kernels' PTX makes these ~50 MB each; compressed they travel in ~14 MB.
strip -o $D/kolo-cuda-test "$TEST" && xz -f -T2 -6 $D/kolo-cuda-test
strip -o $D/user_mlp "$T/release/examples/user_mlp" && xz -f -T2 -6 $D/user_mlp
strip -o $D/kolo target/release/kolo && xz -f -T2 -6 $D/kolo
du -sh $D
