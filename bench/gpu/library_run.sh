#!/usr/bin/env bash
# A user's candle model through kolo::Trainer on an NVIDIA GPU (`train.device = "cuda"`): the
# tests of crates/kolo/tests/cuda.rs (the GPU against the CPU in one process, two launched
# ranks on GPU 0 against one CPU process, the HF Llama fine-tuned), then the user_mlp
# example's step time on the GPU and on the CPU. Runs from the repository root on the GPU
# machine with what bench/gpu/library_build.sh put in .gpu-lib/. Logs under $OUT.
set -u
OUT=${OUT:-/tmp/kolo-gpu}
mkdir -p "$OUT"
D=.gpu-lib
for f in $D/*.xz; do [ -e "$f" ] && xz -dkf "$f"; done
chmod +x $D/kolo $D/kolo-cuda-test $D/user_mlp
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
. bench/gpu/libs.sh
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-4}
echo; echo "== the GPU tests (crates/kolo/tests/cuda.rs)"
KOLO=$PWD/$D/kolo timeout 400 $D/kolo-cuda-test --nocapture --test-threads=1 2>&1 | tee "$OUT/cuda_test.log" \
  | grep -E "^test |diff|SKIPPED|panicked|test result|GPU run|llama-tiny on|error" | head -40
echo; echo "== user_mlp, hidden 1024, batch 256, 200 AdamW steps: GPU, then CPU (RAYON_NUM_THREADS=$RAYON_NUM_THREADS)"
for d in cuda cpu; do
  timeout 120 $D/user_mlp --device $d --hidden 1024 --batch 256 --steps 200 --data test-data/mnist --out "$OUT/mlp-$d" 2>&1 \
    | grep -vE '^\s*$' | tail -3 | sed "s/^/$d: /"
done
