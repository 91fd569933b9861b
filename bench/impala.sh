#!/usr/bin/env bash
# IMPALA on CartPole-v0: environment steps per second taken by 1, 2 and 4 actor threads (the
# learner runs beside them on this machine's cores), and the learned-from environment steps to
# a mean return of 195 over 100 episodes, for seeds 1..R.
#   bash bench/impala.sh [reps]
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
echo "# impala: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for a in 1 2 4; do
  out=$($K impala --actors "$a" --max-steps 400000 --no-stop 2>&1 | grep done:)
  echo "actors $a: $(grep -o '([0-9]*/s' <<<"$out" | tr -d '(') env steps/s; $(grep -o 'policy lag mean [0-9.]*, max [0-9]*' <<<"$out") updates; $(grep -o '[0-9]* trajectories dropped' <<<"$out")"
done
for s in $(seq "$R"); do
  out=$($K impala --actors 2 --max-steps 2000000 --seed "$s" 2>&1 | grep done:)
  echo "seed $s: $(grep -o 'solved at [0-9]* env steps' <<<"$out" || echo 'not solved') ($(grep -o '[0-9]* learner steps' <<<"$out"))"
done
