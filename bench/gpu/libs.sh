# Sourced by the GPU scripts: finds NCCL, cuBLAS and friends (the system's, or the wheels a
# Python install brought) for binaries built without the CUDA toolkit's libraries, and puts
# them on LD_LIBRARY_PATH. cudarc opens `libnccl.so`, pip ships only `libnccl.so.2`: it is
# linked beside.
find_lib() { find /usr/local/cuda* /usr/lib /opt /usr/local/lib -name "$1" 2>/dev/null | head -1; }
NCCL=$(find_lib 'libnccl.so.2'); CUBLAS=$(find_lib 'libcublas.so.13'); CURAND=$(find_lib 'libcurand.so.10')
NVRTC=$(find_lib 'libnvrtc.so.13'); CUDART=$(find_lib 'libcudart.so.13')
mkdir -p /tmp/kolo-libs && ln -sf "$NCCL" /tmp/kolo-libs/libnccl.so
export LD_LIBRARY_PATH=/tmp/kolo-libs:$(dirname "$NCCL"):$(dirname "$CUBLAS"):$(dirname "$CURAND"):$(dirname "$NVRTC"):$(dirname "$CUDART"):${LD_LIBRARY_PATH:-}
echo "libraries: $NCCL $CUBLAS"
