# Sourced by bench/compression.sh and bench/schedule.sh with their arguments (the rates, default
# 100mbit 1gbit; N ranks from the environment, default 2). `shaped_all PATTERN MODE...` runs
# bench/gpt.toml once per rate and MODE ("name|lines for [ddp]") on N ranks over links shaped by
# bench/netem.sh (10 steps), printing rank 0's lines that match PATTERN, one row per mode.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
N=${N:-2}
RATES=("$@")
[ $# -eq 0 ] && RATES=(100mbit 1gbit)
shaped_runs() {
  local rate=$1 n=$2 pattern=$3 m name ddp cfg
  shift 3
  for m in "$@"; do
    name=${m%%|*} ddp=${m#*|}
    cfg=$(mktemp --suffix=.toml)
    sed "s/^\[train\]/[ddp]\n$ddp\n\n[train]/" bench/gpt.toml > "$cfg"
    bash bench/netem.sh "$cfg" "$n" "$rate" 0ms --steps 10 2>/dev/null | grep -E "^\[rank 0\] ($pattern)" | tr '\n' ' ' | sed "s/^/$n ranks | $rate | $name | /"
    echo
    rm -f "$cfg"
  done
}

shaped_all() {
  local pattern=$1 rate
  shift
  for rate in "${RATES[@]}"; do
    shaped_runs "$rate" "$N" "$pattern" "$@"
  done
}
