#!/usr/bin/env bash
# A CUDA 13.0 build toolkit for Kolo's `cuda` feature on a machine without one (and without a
# GPU): nvcc, its compiler back ends and headers from NVIDIA's pip wheels, plus link stubs for
# the driver and libraries that candle links (the real ones are found at run time on the GPU
# machine). Usage: bench/gpu/cuda-toolkit.sh [DIR] (default /tmp/cuda13); then build with
#   PATH=DIR/bin:$PATH CUDA_HOME=DIR CUDA_COMPUTE_CAP=90 cargo build --release -p kolo-cli --features cuda
set -euo pipefail
DIR=${1:-/tmp/cuda13}
W=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$W" \
  "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-cccl==13.0.*"
mkdir -p "$W/x" "$DIR"
for w in "$W"/*.whl; do unzip -q -o "$w" -d "$W/x"; done
cp -a "$W/x/nvidia/cu13/." "$DIR/"
ln -sf libcudart.so.13 "$DIR/lib/libcudart.so"
# Link stubs: every function cudarc declares, under the real libraries' sonames.
CUDARC=$(ls -d ~/.cargo/registry/src/*/cudarc-0.19.* | tail -1)/src
for spec in driver:cuda:libcuda.so.1 cublas:cublas:libcublas.so.13 cublaslt:cublasLt:libcublasLt.so.13 \
            curand:curand:libcurand.so.10 nvrtc:nvrtc:libnvrtc.so.13 nccl:nccl:libnccl.so.2; do
  IFS=: read -r mod lib soname <<< "$spec"
  grep -ohE '^\s*(pub )?fn [A-Za-z_0-9]+\(' "$CUDARC/$mod"/sys/*.rs | sed -E 's/.*fn ([A-Za-z_0-9]+)\(/\1/' | sort -u \
    | awk '{print "void "$1"(void){}"}' > "$W/$lib.c"
  gcc -shared -fPIC -o "$DIR/lib/lib$lib.so" -Wl,-soname,"$soname" "$W/$lib.c"
done
rm -rf "$W"
"$DIR/bin/nvcc" --version | tail -2
echo "CUDA toolkit for building in $DIR"
