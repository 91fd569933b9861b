#!/usr/bin/env bash
# Kolo's all-reduce against Open MPI and torch gloo in one run (issue #21): f32 sum, 2 and 4
# ranks, shared memory / vader and TCP, 4 KiB..256 MiB by x16 (FACTOR=4: every 4x), 3 trials
# each, busbw.
#   PY=/path/to/python [FACTOR=4] bash bench/vs_mpi.sh
# PY: a Python with mpi4py, numpy and psutil (../shared/bench/peers/setup.sh makes one with
# torch too, /opt/peers-venv; gloo is skipped when torch is missing). Kolo's bench binds each
# rank to a core like Open MPI's default; neither binds when the ranks outnumber the cores.
source "$(dirname "$0")/common.sh"
PY="${PY:-python3}"
peers="$(realpath ../shared/bench/peers)"
uptime
$K bench loopback --size 256MiB --trials 5
FACTOR="${FACTOR:-16}"
sizes=""
for ((s = 4096; s <= 268435456; s *= FACTOR)); do sizes="$sizes $s"; done
for n in 2 4; do
  for t in shm tcp; do
    echo "== kolo n=$n $t"
    $K bench collectives -n "$n" --transport "$t" --min 4KiB --max 256MiB --factor "$FACTOR" --trials 3 2>&1 | grep -E '^\[rank 0\] +[0-9]'
  done
  echo "== open mpi n=$n"
  # shellcheck disable=SC2086
  (cd "$peers" && "$PY" bench_mpi_allreduce.py --np "$n" --btl vader tcp --sizes $sizes --trials 3 2>&1 | grep -E '^(vader|  tcp)')
done
if "$PY" -c 'import torch' 2>/dev/null; then
  echo "== torch gloo"
  # shellcheck disable=SC2086
  (cd "$peers" && "$PY" bench_torch_collectives.py --world 2 4 --sizes $sizes --ops all_reduce --trials 3 2>&1 | grep -E '^all_reduce')
fi
uptime
