#!/usr/bin/env bash
# Chaos: what a hostile or unlucky user does to a running job, one line per scenario with the
# time to a clear error (or to recovery) and what was lost. Real processes on 127.0.0.1, the
# release build, the MNIST subset the repository ships.
#   bash bench/chaos.sh                   (about 4 minutes)
#   CHAOS="sigstop partition" bash bench/chaos.sh   (only the scenarios named)
#   CHAOS_LOGS=DIR bash bench/chaos.sh    (keeps every process's log in DIR)
# Scenarios:
#   flood        20,000 junk connections at rank 0's rendezvous store while a 2-rank job trains:
#                rank 0's open descriptors before / at most / after, and whether the job finished
#   ps-kill      SIGKILL of one of 3 parameter servers 4 s into a BSP run (replication 1): the run's
#                rc, its time against an uninterrupted run, and whether the final model is the same
#   coord-restart  the same job with a coordinator process of its own, SIGKILLed 4 s in and started
#                again on its address 2 s later: rc, time, same final model, the recovered epoch
#   ps-pause     SIGSTOP of one of 3 parameter servers for 15 s under the BSP job (dead after 6 s),
#                then SIGCONT, 3 tries: how many end with rc 0, and the first error of the others
#                (issue #34 item 4: a paused server that comes back can wedge the job)
#   sigstop      SIGSTOP of rank 2 of 4 (collective deadline 10 s): time until the launcher exits,
#                and whether every survivor and the launcher name rank 2
#   partition    rank 2 of 3 in a network namespace whose link is cut mid-run (root only): time
#                until the survivors fail, against a collective deadline of 120 s, naming rank 2
#   wrong-token  rank 1 started with another job's token: time until rank 0 reports the refusal
#   world-size   rank 0 told 2 ranks, rank 1 told 3: time until rank 0 says so
#   config       rank 1 with another learning rate: time until a rank names `optim.lr`
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
dir=$(mktemp -d)
keep() { [ -z "${CHAOS_LOGS:-}" ] || { mkdir -p "$CHAOS_LOGS" && cp -r "$dir"/. "$CHAOS_LOGS"/; }; }
trap 'pkill -P $$ 2>/dev/null || true; keep; rm -rf "$dir"' EXIT
mnist=test-data/mnist
echo "# chaos: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
now() { date +%s.%N; }
want() { [ -z "${CHAOS:-}" ] || [[ " $CHAOS " == *" $1 "* ]]; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# pid_of_rank R: the `kolo train` or `kolo selftest` process whose environment has RANK=R.
pid_of_rank() {
  for p in $(pgrep -f "$K (train|selftest)"); do
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$1" && { echo "$p"; return; }
  done
}

# --- flood ---------------------------------------------------------------------------------
if want flood; then
mnist_mlp "$dir/mlp.toml" "$mnist" 500 "progress = false"
sed -i 's/^steps = 200/steps = 15000/; s/^batch_size = 64/batch_size = 16/' "$dir/mlp.toml"
port=$(free_port)
t0=$(now)
$K launch -n 2 --master-port "$port" -- $K train --config "$dir/mlp.toml" > "$dir/flood.log" 2>&1 &
job=$!
until p0=$(pid_of_rank 0) && [ -n "$p0" ] && grep -q "step 500/" "$dir/flood.log"; do sleep 0.2; done
fd0=$(ls "/proc/$p0/fd" | wc -l)
python3 - "$port" "$p0" > "$dir/flood.out" <<'PY' &
# 8 threads open (and half of them write junk into) 20,000 connections as fast as they can;
# rank 0's descriptors are sampled meanwhile.
import os, socket, sys, threading, time
port, pid = int(sys.argv[1]), sys.argv[2]
most, sent, t, lock = 0, 0, time.time(), threading.Lock()
def flood():
    global sent
    while True:
        with lock:
            if sent >= 20000:
                return
            sent += 1
            n = sent
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            if n % 2:
                s.send(os.urandom(64))
            s.close()
        except OSError:
            pass
threads = [threading.Thread(target=flood) for _ in range(8)]
for th in threads:
    th.start()
while any(th.is_alive() for th in threads):
    try:
        most = max(most, len(os.listdir(f"/proc/{pid}/fd")))
    except OSError:
        break
    time.sleep(0.05)
for th in threads:
    th.join()
print(sent, most, round(time.time() - t, 1))
PY
flooder=$!
wait $flooder
read -r sent most took < "$dir/flood.out"
fd1=$( (ls "/proc/$p0/fd" 2>/dev/null || true) | wc -l)
wait $job && rc=0 || rc=$?
acc=$(grep -o 'accuracy [0-9.]*%' "$dir/flood.log" | tail -1)
echo "flood: $sent connections in $took s; rank 0 descriptors $fd0 before, at most $most, $fd1 after; job rc $rc after $(secs "$t0" "$(now)") s, final $acc; refusals logged: $(grep -c 'refused' "$dir/flood.log") line(s)"
fi

# --- ps-kill -------------------------------------------------------------------------------
sed 's/^steps = 600/steps = 1500/; s/^consistency = "async".*/consistency = "bsp"/; s/^log_every = 100/log_every = 500/' examples/mnist_ps.toml > "$dir/ps.toml"
if want ps-kill; then
t0=$(now)
$K ps run -n 2 --servers 3 --config "$dir/ps.toml" > "$dir/ps-ref.log" 2>&1 && rc_ref=0 || rc_ref=$?
t_ref=$(secs "$t0" "$(now)")
t0=$(now)
$K ps run -n 2 --servers 3 --config "$dir/ps.toml" > "$dir/ps-kill.log" 2>&1 &
job=$!
sleep 4
victim=$(pgrep -f "$K ps serve" | tail -1)
kill -9 "$victim"
wait $job && rc=0 || rc=$?
t_kill=$(secs "$t0" "$(now)")
ref=$(grep -o 'final eval.*' "$dir/ps-ref.log" | tail -1)
got=$(grep -o 'final eval.*' "$dir/ps-kill.log" | tail -1)
same=$([ -n "$got" ] && [ "$got" = "$ref" ] && echo "the same final model (0 acknowledged updates lost)" || echo "a different final model: '$got' vs '$ref'")
echo "ps-kill: rc $rc in $t_kill s (uninterrupted: rc $rc_ref in $t_ref s); $same; $(grep -c 'missed its heartbeats' "$dir/ps-kill.log") server(s) declared dead"
fi

# --- coord-restart -------------------------------------------------------------------------
if want coord-restart; then
# coord_job NAME KILL: coordinator, 3 servers and 2 workers as processes of their own (the
# workers are `kolo train` ranks told the coordinator's address); with KILL=1 the coordinator is
# SIGKILLed 4 s in and a new one started on the same address 2 s later.
coord_job() {
  local addr tok coord job t0 i
  addr="127.0.0.1:$(free_port)"
  tok=$(printf 'c%.0s' {1..32})
  export KOLO_JOB_TOKEN=$tok
  $K ps coordinator --listen "$addr" --dead-after 6 > "$dir/$1-coord.log" 2>&1 &
  coord=$!
  for i in 1 2 3; do $K ps serve --coordinator "$addr" > "$dir/$1-s$i.log" 2>&1 & done
  t0=$(now)
  for i in 0 1; do
    RANK=$i WORLD_SIZE=2 KOLO_PS_COORDINATOR=$addr KOLO_PS_SERVERS=3 $K train --config "$dir/ps.toml" > "$dir/$1-w$i.log" 2>&1 &
    eval "w$i=\$!"
  done
  if [ "$2" = 1 ]; then
    sleep 4
    kill -9 "$coord"
    wait "$coord" 2> /dev/null || true
    sleep 2
    $K ps coordinator --listen "$addr" --dead-after 6 >> "$dir/$1-coord.log" 2>&1 &
    coord=$!
  fi
  wait "$w0" && rc=0 || rc=$?
  wait "$w1" || rc=$((rc + $?))
  took=$(secs "$t0" "$(now)")
  $K ps shutdown --coordinator "$addr" > /dev/null 2>&1 || true
  wait "$coord" 2> /dev/null || true
  unset KOLO_JOB_TOKEN
}
coord_job coord-ref 0
rc_ref=$rc t_ref=$took
coord_job coord-kill 1
ref=$(grep -o 'final eval.*' "$dir/coord-ref-w0.log" | tail -1)
got=$(grep -o 'final eval.*' "$dir/coord-kill-w0.log" | tail -1)
same=$([ -n "$got" ] && [ "$got" = "$ref" ] && echo "the same final model" || echo "a different final model: '$got' vs '$ref'")
echo "coord-restart: rc $rc in $took s (uninterrupted: rc $rc_ref in $t_ref s); $same; new coordinator: $(grep -m1 -io 'recovered.*' "$dir/coord-kill-coord.log" | cut -c1-120)"
fi

# --- ps-pause ------------------------------------------------------------------------------
if want ps-pause; then
ok=0 first=""
for try in 1 2 3; do
  addr="127.0.0.1:$(free_port)"
  export KOLO_JOB_TOKEN=$(printf 'd%.0s' {1..32})
  $K ps coordinator --listen "$addr" --dead-after 6 > "$dir/pause$try-coord.log" 2>&1 &
  coord=$!
  servers=()
  for i in 1 2 3; do $K ps serve --coordinator "$addr" --heartbeat-ms 100 > "$dir/pause$try-s$i.log" 2>&1 & servers+=($!); done
  sleep 1
  for i in 0 1; do
    RANK=$i WORLD_SIZE=2 KOLO_PS_COORDINATOR=$addr $K train --config "$dir/ps.toml" --steps 1500 > "$dir/pause$try-w$i.log" 2>&1 &
    eval "w$i=\$!"
  done
  sleep 4
  kill -STOP "${servers[1]}"; sleep 15; kill -CONT "${servers[1]}"
  wait "$w0" && rc=0 || rc=$?
  wait "$w1" || rc=$((rc + $?))
  if [ "$rc" = 0 ]; then ok=$((ok + 1)); elif [ -z "$first" ]; then first=$(grep -h -m1 -o 'answered Push with Error.*' "$dir/pause$try-w0.log" "$dir/pause$try-w1.log" | head -1 | cut -c1-160); fi
  $K ps shutdown --coordinator "$addr" > /dev/null 2>&1 || true
  sleep 1
  kill "$coord" "${servers[@]}" 2> /dev/null || true
  wait "$coord" "${servers[@]}" 2> /dev/null || true
  unset KOLO_JOB_TOKEN
done
echo "ps-pause: $ok of 3 runs finished after a 15 s SIGSTOP of a server${first:+; first failure: $first}"
fi

# --- sigstop -------------------------------------------------------------------------------
if want sigstop; then
mnist_mlp "$dir/hang.toml" "$mnist" 1000 "progress = false"
sed -i 's/^steps = 200/steps = 100000/; s/^batch_size = 64/batch_size = 8/' "$dir/hang.toml"
printf '[ddp]\ntimeout_secs = 10\n' >> "$dir/hang.toml"
$K launch -n 4 -- $K train --config "$dir/hang.toml" 2>&1 | while IFS= read -r line; do printf '%s %s\n' "$(now)" "$line"; done > "$dir/hang.log" &
job=$!
until p2=$(pid_of_rank 2) && [ -n "$p2" ] && grep -q "step 1000/" "$dir/hang.log"; do sleep 0.2; done
t0=$(now)
kill -STOP "$p2"
wait $job || true
rc=$(grep -c 'job failed' "$dir/hang.log")
t=$(secs "$t0" "$(now)")
t_err=$(grep -m1 '\] error' "$dir/hang.log" | cut -d' ' -f1)
kill -CONT "$p2" 2>/dev/null || true
named=0
for r in 0 1 3; do grep "\[rank $r\] error" "$dir/hang.log" | grep -q 'rank(s) \[2\]' && named=$((named + 1)); done
launcher=$(grep -o 'job failed: rank [0-9]*' "$dir/hang.log" | head -1)
echo "sigstop: first survivor's error $(secs "$t0" "$t_err") s and the launcher's exit $t s after SIGSTOP of rank 2 (deadline 10 s); $named of 3 survivors name rank 2; launcher: '$launcher'"
fi

# --- partition -----------------------------------------------------------------------------
# Rank 2 of 3 runs in a network namespace of its own behind a veth pair; 3 s into the run the
# pair is taken down: no FIN, no RST, the packets simply vanish. Needs root and iproute2 (this
# machine's kernel has no netem, so packet loss is not simulated).
partition() {
  if [ "$(id -u)" != 0 ] || ! command -v ip > /dev/null; then
    echo "partition: skipped (needs root and iproute2 for a network namespace)"
    return
  fi
  local ns=kolo-chaos-$$ port tok t0 t r
  ip netns add "$ns"
  trap 'ip netns del '"$ns"' 2>/dev/null || true; ip link del kchaos0 2>/dev/null || true; pkill -P $$ 2>/dev/null || true; keep; rm -rf "$dir"' EXIT
  ip link add kchaos0 type veth peer name kchaos1
  ip link set kchaos1 netns "$ns"
  ip addr add 10.77.0.1/24 dev kchaos0 && ip link set kchaos0 up
  ip netns exec "$ns" ip addr add 10.77.0.2/24 dev kchaos1
  ip netns exec "$ns" ip link set kchaos1 up
  ip netns exec "$ns" ip link set lo up
  mnist_mlp "$dir/part.toml" "$mnist" 1000 "progress = false"
  sed -i 's/^steps = 200/steps = 100000/; s/^batch_size = 64/batch_size = 8/' "$dir/part.toml"
  printf "[ddp]\ntimeout_secs = ${PART_DEADLINE:-120}\n" >> "$dir/part.toml"
  port=$(free_port)
  tok=$(printf 'd%.0s' {1..32})
  for r in 0 1 2; do
    local pre=() host=a
    [ "$r" = 2 ] && pre=(ip netns exec "$ns") host=b
    RANK=$r WORLD_SIZE=3 MASTER_ADDR=10.77.0.1 MASTER_PORT=$port KOLO_JOB_TOKEN=$tok KOLO_HOST_ID=$host \
      "${pre[@]}" $K train --config "$dir/part.toml" 2>&1 | while IFS= read -r line; do printf '%s %s\n' "$(now)" "$line"; done > "$dir/part-$r.log" &
  done
  until grep -q "step 1000/" "$dir/part-0.log" 2> /dev/null; do sleep 0.2; done
  t0=$(now)
  ip netns exec "$ns" ip link set kchaos1 down
  wait
  t=$(secs "$t0" "$(now)")
  local named=0 first=
  for r in 0 1; do
    grep -i 'error' "$dir/part-$r.log" | grep -q 'rank 2\|rank(s) \[2\]' && named=$((named + 1))
    [ -z "$first" ] && first=$(grep -m1 -i 'error' "$dir/part-$r.log" | cut -d' ' -f1)
  done
  echo "partition: survivors' first error $(secs "$t0" "${first:-$t0}") s, all ranks exited $t s after the cut (collective deadline ${PART_DEADLINE:-120} s); $named of 2 survivors name rank 2: $(grep -m1 -io 'error.*' "$dir/part-0.log" | cut -c1-150)"
  ip netns del "$ns"
  ip link del kchaos0 2> /dev/null || true
}
want partition && partition

# --- wrong-token, world-size ---------------------------------------------------------------
if want wrong-token || want world-size; then
rendezvous() { # NAME TOKEN1 WORLD1: rank 0 (token aa.., world 2) and rank 1 (TOKEN1, WORLD1)
  local port t0 t
  port=$(free_port)
  t0=$(now)
  RANK=0 WORLD_SIZE=2 MASTER_PORT=$port KOLO_JOB_TOKEN=$(printf 'a%.0s' {1..32}) $K selftest --iters 5 --timeout 300 > "$dir/$1-0.log" 2>&1 &
  local r0=$!
  RANK=1 WORLD_SIZE=$3 MASTER_PORT=$port KOLO_JOB_TOKEN=$2 $K selftest --iters 5 --timeout 300 > "$dir/$1-1.log" 2>&1 &
  local r1=$!
  wait $r0 || true
  t=$(secs "$t0" "$(now)")
  wait $r1 || true
  echo "$1: rank 0 failed after $t s: $(grep -m1 -io 'error.*' "$dir/$1-0.log" | cut -c1-160)"
}
rendezvous wrong-token "$(printf 'b%.0s' {1..32})" 2
rendezvous world-size "$(printf 'a%.0s' {1..32})" 3
fi

# --- config --------------------------------------------------------------------------------
if want config; then
for r in 0 1; do
  mnist_mlp "$dir/cfg-$r.toml" "$mnist" 100 "progress = false"
done
sed -i 's/^lr = 1e-3/lr = 2e-3/' "$dir/cfg-1.toml"
t0=$(now)
$K launch -n 2 -- sh -c "exec $K train --config $dir/cfg-\$RANK.toml" > "$dir/cfg.log" 2>&1 && rc=0 || rc=$?
echo "config: rc $rc after $(secs "$t0" "$(now)") s: $(grep -m1 -o 'rank 1 differs.*' "$dir/cfg.log" | cut -c1-140)"
fi
