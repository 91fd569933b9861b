#!/usr/bin/env bash
# Kolo's all-reduce against Open MPI called from C (bench/mpi_allreduce.c, no Python between),
# issue #37: f32 sum, 2 and 4 ranks, shared memory (Kolo shm, Open MPI vader) and TCP over
# loopback, every 4x size from 4 KiB to 256 MiB, both timed the same way (back-to-back calls,
# the slowest rank's mean per trial, the median of 3 trials). The two alternate, configuration by
# configuration, for R rounds (default 3), because this machine's speed changes from minute to
# minute; the summary gives each size's median over the rounds and Kolo's time over Open MPI's.
#   bash bench/vs_mpi_c.sh [R]      (needs mpicc and mpirun: Open MPI)
source "$(dirname "$0")/common.sh"
MPI_BIN=target/mpi_allreduce
mpicc -O2 -o "$MPI_BIN" bench/mpi_allreduce.c -lm
MCA=(--allow-run-as-root --oversubscribe --mca pml ob1 --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo)
LOG=$(mktemp)
echo "# $(lscpu | grep 'Model name' | sed 's/ \+/ /g'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $(mpirun --version | head -1)"
for ((r = 1; r <= R; r++)); do
  for n in 2 4; do
    for t in shm tcp; do
      btl=$([ "$t" = shm ] && echo self,vader || echo self,tcp)
      $K bench collectives -n "$n" --transport "$t" --min 4KiB --max 256MiB --factor 4 --trials 3 --trial-secs 0.1 2>&1 |
        awk -v r="$r" -v n="$n" -v t="$t" '$1 == "[rank" && $3 ~ /^[0-9]+$/ { print r, "kolo", n, t, $3, $6 }' >> "$LOG"
      mpirun "${MCA[@]}" -n "$n" --mca btl "$btl" "$MPI_BIN" 4096 268435456 4 3 0.1 2>/dev/null |
        awk -v r="$r" -v n="$n" -v t="$t" '{ print r, "openmpi", n, t, $1, $2 }' >> "$LOG"
    done
  done
  echo "# round $r done, load $(cut -d' ' -f1-3 /proc/loadavg)"
done
python3 - "$LOG" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r, sysname, n, t, size, us = line.split()
    runs[(sysname, int(n), t, int(size))].append(float(us))
print(f"{'ranks':>5} {'links':>5} {'bytes':>10} {'kolo us':>10} {'open mpi us':>12} {'kolo/mpi':>9}  (medians over rounds; each round's Kolo and Open MPI figures side by side in the log)")
for n in (2, 4):
    for t in ("shm", "tcp"):
        for size in sorted({k[3] for k in runs if k[1] == n and k[2] == t}):
            k, m = runs.get(("kolo", n, t, size)), runs.get(("openmpi", n, t, size))
            if not k or not m:
                continue
            mk, mm = statistics.median(k), statistics.median(m)
            print(f"{n:>5} {t:>5} {size:>10} {mk:>10.2f} {mm:>12.2f} {mk / mm:>9.2f}")
PY
echo "# raw: $LOG"
