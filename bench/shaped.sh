# Sourced by bench/compression.sh and bench/schedule.sh: `shaped_runs RATE N PATTERN MODE...`
# runs bench/gpt.toml once per MODE ("name|lines for [ddp]") on N ranks over links shaped to
# RATE by bench/netem.sh (10 steps), printing rank 0's lines that match PATTERN, one row per mode.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
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
