#!/bin/bash
# A real Slurm cluster on this one machine, for tests and for trying rlray.sbatch by hand:
# munged, slurmctld and N slurmd daemons (N Slurm nodes sharing this host's CPUs and memory),
# everything (config, keys, sockets, state, logs) under one folder, nothing in /etc touched.
#
#   docker/slurm/local_cluster.sh start DIR [NODES]   # NODES=2 by default; prints `export SLURM_CONF=...`
#   SLURM_CONF=DIR/slurm.conf sbatch --nodes=2 --cpus-per-task=1 docker/slurm/rlray.sbatch ...
#   docker/slurm/local_cluster.sh stop DIR            # stops every daemon started from DIR
#
# Needs root (slurmd runs jobs as their user) and Debian's slurm-wlm 22.05 (installed here with
# apt-get when missing). cgroups are off (proctrack/linuxproc, task/none), so it runs in a
# container. Each node declares the host's CPUs and memory; jobs on different nodes share them.
set -euo pipefail

die() { echo "local_cluster: $*" >&2; exit 1; }

# N free ports, all held open until every one is chosen, so no two of them are the same port
free_ports() {
    python3 -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("0.0.0.0", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}

install() {
    command -v slurmctld >/dev/null && command -v munged >/dev/null && return
    (( EUID == 0 )) || die "slurm-wlm is not installed and installing it needs root"
    echo "local_cluster: installing slurm-wlm (Debian)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm >/dev/null
}

write_conf() {
    local dir=$1 nodes=$2 cpus mem_mb host i ports
    cpus=$(nproc)
    mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) * 9 / 10240 ))
    host=$(hostname -s)
    read -r -a ports <<< "$(free_ports $((nodes + 1)))"
    cat > "$dir/slurm.conf" <<EOF
ClusterName=rlray-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=${ports[0]}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmdTimeout=30
InactiveLimit=0
KillWait=3
EOF
    for (( i = 1; i <= nodes; i++ )); do
        echo "NodeName=node$i NodeHostname=$host NodeAddr=127.0.0.1 Port=${ports[i]} CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN" \
            >> "$dir/slurm.conf"
    done
    echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" >> "$dir/slurm.conf"
}

start_munge() {
    local dir=$1
    mkdir -p "$dir/munge"
    chmod 700 "$dir/munge"
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
    munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"
}

wait_idle() {
    local nodes=$1 deadline=$((SECONDS + 60))
    until (( $(sinfo -h -N -t idle -o '%N' 2>/dev/null | wc -l) >= nodes )); do
        (( SECONDS < deadline )) || { sinfo -N >&2 || true; die "the Slurm nodes did not come up in 60 s (logs in $DIR/log)"; }
        sleep 1
    done
}

start() {
    local nodes=${1:-2} i
    (( EUID == 0 )) || die "needs root: slurmd runs each job as its user"
    install
    mkdir -p "$DIR"/{state,spool,log}
    DIR=$(cd "$DIR" && pwd)
    write_conf "$DIR" "$nodes"
    export SLURM_CONF=$DIR/slurm.conf
    start_munge "$DIR"
    slurmctld -f "$SLURM_CONF"
    for (( i = 1; i <= nodes; i++ )); do
        mkdir -p "$DIR/spool/node$i"
        slurmd -f "$SLURM_CONF" -N "node$i"
    done
    wait_idle "$nodes"
    echo "export SLURM_CONF=$SLURM_CONF"
}

stop() {
    local pidfile pid
    [[ -d "$DIR" ]] || return 0
    scancel --full --quiet -u "$(id -un)" 2>/dev/null || true
    for pidfile in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do
        [[ -f "$pidfile" ]] || continue
        pid=$(cat "$pidfile")
        kill "$pid" 2>/dev/null || continue
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -9 "$pid" 2>/dev/null || true
    done
}

[[ $# -ge 2 ]] || die "usage: $0 start DIR [NODES] | stop DIR"
DIR=$2
export SLURM_CONF=$DIR/slurm.conf
case $1 in
    start) start "${3:-2}" ;;
    stop) stop ;;
    *) die "unknown command $1 (start or stop)" ;;
esac
