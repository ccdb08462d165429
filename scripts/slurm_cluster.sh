#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for tests/test_slurm.py and for trying the
# `hydra/launcher=slurm` preset without a cluster.
#
#   scripts/slurm_cluster.sh install   # apt-get install slurm-wlm munge (only if slurmctld is missing; root)
#   scripts/slurm_cluster.sh start     # write the config, start munged, slurmctld, slurmd; wait for an idle node
#   scripts/slurm_cluster.sh status    # is it up? (exit 0 when the node answers, 1 otherwise)
#   scripts/slurm_cluster.sh env       # the line to eval in a shell: export SLURM_CONF=...
#   scripts/slurm_cluster.sh stop      # cancel its jobs, stop the three daemons; the state dir (config, logs) is kept
#
# Everything lives in one state dir, $TREAD_SLURM_DIR (default /tmp/tread-slurm): slurm.conf, the munge key
# and socket, slurmctld's state, slurmd's spool, pid files, logs and the job completion log. Nothing under
# /etc is written: clients find the cluster through SLURM_CONF=$TREAD_SLURM_DIR/slurm.conf (`eval "$(... env)"`),
# and jobs inherit it (sbatch exports the submitter's environment).
#
# The node is this host (`hostname -s`, reached at 127.0.0.1) with the CPUs and memory `slurmd -C` reports, in
# one default partition. Daemons run as root (SlurmUser=root). No cgroups (ProctrackType=proctrack/linuxproc,
# TaskPlugin=task/none), so it also runs in containers. select/cons_tres with CR_Core: jobs get cores, not the
# whole node, and memory is not a consumable, so two 1-CPU jobs share a 2-core node. Made quick for tests:
# JobRequeue=1 (batch jobs may be requeued); a requeued job may start again after cred_expire=5 s (SLURM's
# default is 120 s) and the scheduler looks every 2 s, so a requeue restarts the job within ~10 s;
# KillWait=10 (SIGTERM -> SIGKILL); MinJobAge=30 (finished jobs leave squeue). Time limits and --signal
# warnings are checked by slurmctld every 30 s (fixed in SLURM): a warning may come up to 30 s early.
#
# sacct: slurm 22.05 has no accounting_storage/filetxt any more (only `none` and `slurmdbd`), and without
# slurmdbd a plain `sacct` fails ("Slurm accounting storage is disabled"): submitit then logs a warning at every
# poll, and as it never learns a job's state, a job that dies without writing its result (killed, time limit,
# node failure) leaves the submitting `train.py -m` waiting forever. jobcomp/filetxt still works and
# `sacct --completion` (-c) reads its file, but submitit calls plain `sacct`. So `start` also writes
# $TREAD_SLURM_DIR/bin/sacct, a wrapper that adds -c; with that dir first on PATH (the `env` line) submitit's
# polls succeed: finished jobs show their final state (COMPLETED, FAILED, TIMEOUT, CANCELLED), a requeued one
# PENDING, and running ones are absent, which submitit reads as "not done yet".
#
# Ports: SlurmctldPort/SlurmdPort default to 6817/6818; TREAD_SLURM_CTLD_PORT / TREAD_SLURM_SLURMD_PORT move them
# (e.g. when another SLURM runs on this machine).
set -euo pipefail

STATE="${TREAD_SLURM_DIR:-/tmp/tread-slurm}"
CONF="$STATE/slurm.conf"
CTLD_PORT="${TREAD_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT="${TREAD_SLURM_SLURMD_PORT:-6818}"
START_TIMEOUT="${TREAD_SLURM_START_TIMEOUT:-30}"   # seconds to wait for an idle node
HOST="$(hostname -s)"
export SLURM_CONF="$CONF"
PATH="$PATH:/usr/sbin:/sbin"   # munged, slurmctld and slurmd live there; not on every user's PATH

# What a shell needs to use this cluster: eval "$(scripts/slurm_cluster.sh env)".
env_line() { echo "export SLURM_CONF=$CONF PATH=$STATE/bin:\$PATH"; }
die() { echo "slurm_cluster: $*" >&2; exit 1; }
say() { echo "slurm_cluster: $*"; }

# The pid in a pid file, if that process is alive.
live_pid() {
    local pid
    [[ -f "$1" ]] || return 1
    pid="$(cat "$1" 2>/dev/null)" || return 1
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

need_binaries() {
    local missing=()
    for b in munged slurmctld slurmd sinfo sbatch scontrol; do
        command -v "$b" >/dev/null 2>&1 || missing+=("$b")
    done
    if ((${#missing[@]})); then
        die "not installed: ${missing[*]} (run: scripts/slurm_cluster.sh install, or apt-get install slurm-wlm munge)"
    fi
}

install() {
    if command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; then
        say "slurm-wlm and munge are already installed"
        return 0
    fi
    [[ "$(id -u)" == 0 ]] || die "install needs root (apt-get)"
    # The packages' post-install scripts try to start the system services; in containers that is refused
    # (policy-rc.d) or has no systemd, which is fine: `start` runs its own daemons.
    # A fresh container may have no package lists yet: update them and retry once.
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends slurm-wlm munge \
        || { apt-get update && apt-get install -y --no-install-recommends slurm-wlm munge; }
}

write_config() {
    local node_line
    # `slurmd -C` prints "NodeName=<host> CPUs=.. Boards=.. SocketsPerBoard=.. CoresPerSocket=.. ThreadsPerCore=..
    # RealMemory=.." for this machine; keep its hardware fields, name the node like SlurmctldHost.
    node_line="$(slurmd -C | head -n1 | sed -E 's/^NodeName=[^ ]+ //')"
    [[ "$node_line" == *CPUs=* ]] || die "cannot read this host's hardware from 'slurmd -C'"
    mkdir -p "$STATE"/{ctld,spool,log,run,munge,bin}
    chmod 755 "$STATE/munge"   # its socket must be reachable; the key itself is private (0400)
    cat >"$CONF" <<EOF
# Written by scripts/slurm_cluster.sh: a single-node test cluster on $HOST. Rewritten at every start.
ClusterName=tread
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=$STATE/munge/munge.socket,cred_expire=5
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: works in containers; processes are tracked through /proc.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
# Cores are the consumable resource (not memory), so small jobs share the node.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Look at pending jobs every 2 s, not every 30-60 s: a requeued job starts soon after its BeginTime.
SchedulerParameters=sched_interval=2,bf_interval=2
MailProg=/bin/true   # no mail (the default path does not exist: an error line at start)
# Requeue (scontrol requeue, preemption, train()'s time-limit requeue) is allowed for batch jobs.
JobRequeue=1
# SIGTERM -> SIGKILL after 10 s; finished jobs leave squeue/scontrol after 30 s.
KillWait=10
MinJobAge=30
InactiveLimit=0
ReturnToService=2
# No slurmdbd: job accounting off; completed jobs go to a text file that sacct -c reads (see bin/sacct).
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/log/jobcomp.txt
NodeName=$HOST NodeAddr=127.0.0.1 $node_line State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
    # submitit polls `sacct -o JobID,State,NodeList --parsable2 -j ID`: answer it from the job completion log.
    local real_sacct
    real_sacct="$(command -v sacct)" || die "sacct is not installed"
    [[ "$real_sacct" != "$STATE/bin/sacct" ]] || real_sacct=/usr/bin/sacct
    cat >"$STATE/bin/sacct" <<EOF
#!/bin/sh
# Written by scripts/slurm_cluster.sh: no slurmdbd here, so read the job completion log instead (sacct -c).
SLURM_CONF="\${SLURM_CONF:-$CONF}" exec $real_sacct -c "\$@"
EOF
    chmod 755 "$STATE/bin/sacct"
}

start_munge() {
    local key="$STATE/munge/munge.key"
    if [[ ! -s "$key" ]]; then
        # A fresh random key; munged wants it private to its (root) user.
        dd if=/dev/urandom of="$key" bs=1 count=1024 status=none
        chmod 400 "$key"
    fi
    if live_pid "$STATE/munge/munged.pid" >/dev/null; then
        return 0
    fi
    rm -f "$STATE/munge/munge.socket" "$STATE/munge/munge.socket.lock"
    # --force: munged is picky about the permissions of every directory above its socket and key (/tmp is
    # world-writable with the sticky bit); this is a throwaway test key.
    munged --force --socket="$STATE/munge/munge.socket" --key-file="$key" --pid-file="$STATE/munge/munged.pid" \
        --log-file="$STATE/log/munged.log" --seed-file="$STATE/munge/munged.seed" \
        || die "munged did not start (see $STATE/log/munged.log)"
}

# A start that failed: say why (the daemons' last log lines), stop what was started, exit 1.
fail_start() {
    echo "slurm_cluster: $*" >&2
    for log in slurmctld slurmd munged; do
        echo "--- last lines of $STATE/log/$log.log" >&2
        tail -n 15 "$STATE/log/$log.log" >&2 2>/dev/null || true
    done
    stop >/dev/null 2>&1 || true
    exit 1
}

start() {
    need_binaries
    if status >/dev/null 2>&1; then
        say "already up ($CONF)"
        return 0
    fi
    write_config
    start_munge
    # -c (slurmctld): a clean start, no jobs from an earlier run of this state dir. Both daemons fork and return
    # at once; a failure to bind a port or read the config shows up below as a dead daemon.
    live_pid "$STATE/run/slurmctld.pid" >/dev/null || slurmctld -c -f "$CONF" || fail_start "slurmctld did not start"
    live_pid "$STATE/run/slurmd.pid" >/dev/null || slurmd -f "$CONF" || fail_start "slurmd did not start"
    local begin=$SECONDS state="" name
    while ((SECONDS < begin + START_TIMEOUT)); do
        state="$(timeout 10 sinfo -h -N -n "$HOST" -o %T 2>/dev/null || true)"
        case "$state" in
            idle*|mixed*|allocated*) say "up: node $HOST $state; $(env_line)"
                                     return 0 ;;
            down*|drain*)            # a node left down by an earlier run: bring it back
                                     scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true ;;
        esac
        if ((SECONDS >= begin + 3)); then   # the pid files exist by now: a daemon that died will not come back
            for name in slurmctld slurmd; do
                live_pid "$STATE/run/$name.pid" >/dev/null \
                    || fail_start "$name exited (a port in use? see $STATE/log/$name.log)"
            done
        fi
        sleep 1
    done
    fail_start "the node did not become idle within ${START_TIMEOUT}s (sinfo: '${state:-no answer}')"
}

stop() {
    local name pid file jobs
    # Cancel the jobs first: slurmstepd and the job's processes outlive slurmd otherwise.
    jobs="$(timeout 10 squeue -h -o %i 2>/dev/null || true)"
    if [[ -n "$jobs" ]]; then
        # shellcheck disable=SC2086
        timeout 10 scancel $jobs >/dev/null 2>&1 || true
        for _ in $(seq 30); do
            [[ -z "$(timeout 10 squeue -h -o %i 2>/dev/null || true)" ]] && break
            sleep 0.5
        done
        say "cancelled jobs: $(echo $jobs)"
    fi
    # SIGTERM to all three, then wait for each (up to 5 s; SIGKILL after that).
    local -A pids=()
    for name in slurmd slurmctld munged; do
        file="$STATE/run/$name.pid"
        [[ "$name" == munged ]] && file="$STATE/munge/munged.pid"
        if pid="$(live_pid "$file")"; then
            pids[$name]=$pid
            kill "$pid" 2>/dev/null || true
        fi
    done
    for name in slurmd slurmctld munged; do
        [[ -n "${pids[$name]:-}" ]] || continue
        pid=${pids[$name]}
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
        say "stopped $name ($pid)"
    done
}

status() {
    [[ -f "$CONF" ]] || { echo "slurm_cluster: not configured ($CONF missing)"; return 1; }
    # No controller of this state dir running: down (without waiting for sinfo to give up on it).
    live_pid "$STATE/run/slurmctld.pid" >/dev/null || { echo "slurm_cluster: down ($CONF)"; return 1; }
    local state
    state="$(timeout 10 sinfo -h -N -n "$HOST" -o %T 2>/dev/null || true)"
    if [[ -n "$state" ]]; then
        echo "slurm_cluster: up ($CONF): node $HOST $state"
        timeout 10 squeue -h -o '%i %T %j' 2>/dev/null | sed 's/^/  job /' || true
        return 0
    fi
    echo "slurm_cluster: down ($CONF)"
    return 1
}

case "${1:-}" in
    install) install ;;
    start)   start ;;
    stop)    stop ;;
    status)  status ;;
    env)     env_line ;;
    *)       echo "usage: $0 install|start|stop|status|env   (state dir: \$TREAD_SLURM_DIR, now $STATE)" >&2; exit 2 ;;
esac
