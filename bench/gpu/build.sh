#!/usr/bin/env bash
# Builds what bench/gpu/run.sh needs into .gpu/ (git-ignored), on this machine: kolo with
# candle's CUDA backend and NCCL, the CUDA model test, and kolo-nccl-check built the way a
# user without the CUDA toolkit builds it (cudarc loads libcuda and libnccl at run time).
# Needs nvcc 13 (bench/gpu/cuda-toolkit.sh makes one) and ../shared for the data.
set -euo pipefail
CUDA=${CUDA_HOME:-/tmp/cuda13}
T=${CUDA_TARGET_DIR:-target/cuda}
[ -x "$CUDA/bin/nvcc" ] || bash bench/gpu/cuda-toolkit.sh "$CUDA"
export PATH=$CUDA/bin:$PATH CUDA_HOME=$CUDA CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
cargo build --release -p kolo-cli --features cuda,nccl --target-dir "$T"
TEST=$(cargo test --release -p kolo-tensor --features cuda --test cuda --no-run --target-dir "$T" --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and m["target"]["name"] == "cuda"][-1])')
env -u CUDA_HOME PATH=${PATH#"$CUDA/bin:"} cargo build --release -p kolo-nccl --features nccl
mkdir -p .gpu
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
# xz: the CUDA kernels' PTX makes these ~50 MB each; compressed they travel in ~14 MB.
strip -o .gpu/kolo "$T/release/kolo" && xz -f -T2 -6 .gpu/kolo
strip -o .gpu/tensor-cuda-test "$TEST" && xz -f -T2 -6 .gpu/tensor-cuda-test
strip -o .gpu/kolo-nccl-check target/release/kolo-nccl-check
cp ../shared/data/tinyshakespeare.txt ../shared/bench/peers/peerbench_models.py bench/gpu/torch_gpt.py .gpu/
du -sh .gpu
