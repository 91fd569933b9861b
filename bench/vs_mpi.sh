#!/usr/bin/env bash
# Kolo's all-reduce against Open MPI in one run (issue #21): f32 sum, 2 and 4 ranks, shared
# memory / vader and TCP, 4 KiB..256 MiB (16 MiB at 4 ranks) by x16, 3 trials each, busbw.
#   PY=/path/to/python-with-mpi4py bash bench/vs_mpi.sh
# PY: a Python with mpi4py, numpy and psutil (python3 -m venv V && V/bin/pip install mpi4py
# numpy psutil); ../shared/bench/peers holds the MPI side's script.
source "$(dirname "$0")/common.sh"
PY="${PY:-python3}"
peers="$(realpath ../shared/bench/peers)"
uptime
$K bench loopback --size 256MiB --trials 5 2>&1 | tail -2
for n in 2 4; do
  max=256MiB; sizes="4096 65536 1048576 16777216 268435456"
  if [ "$n" = 4 ]; then max=16MiB; sizes="4096 65536 1048576 16777216"; fi
  for t in shm tcp; do
    echo "== kolo n=$n $t"
    $K bench collectives -n "$n" --transport "$t" --min 4KiB --max "$max" --factor 16 --trials 3 2>&1 | grep -E '^\[rank 0\] +[0-9]'
  done
  echo "== open mpi n=$n"
  # shellcheck disable=SC2086
  (cd "$peers" && "$PY" bench_mpi_allreduce.py --np "$n" --btl vader tcp --sizes $sizes --trials 3 2>&1 | grep -E '^(vader|  tcp)')
done
uptime
