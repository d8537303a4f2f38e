#!/usr/bin/env bash
# Local Slurm clusters on this machine, for hvdtrain's Slurm tests and for trying `hvdtrain slurm`.
#   bash scripts/slurm_local.sh start    one-node cluster: install (Debian packages, when missing),
#                                        configure, start, wait until the node is idle
#   bash scripts/slurm_local.sh stop     stop the daemons started here
#   bash scripts/slurm_local.sh status   the daemons and `sinfo`
#   ... start|stop|status --nodes        the same for a second cluster over the network-namespace nodes
#                                        of scripts/cluster_local.sh (start that first): its own
#                                        slurmctld and ports, one slurmd per node inside the node's
#                                        namespace; use it with SLURM_CONF=$HVDTRAIN_CLUSTER_DIR/slurm/slurm.conf
#                                        (`source $HVDTRAIN_CLUSTER_DIR/env` sets it)
# Needs root (Debian 12: slurmctld, slurmd, slurm-client and munge 22.05). Idempotent: `start` on a
# running cluster only checks it. One-node config: /etc/slurm/slurm.conf; state and logs under
# /var/spool/slurm-local. Daemons are found by their pid files, never by name: the two clusters'
# daemons share names, and a killed daemon may linger <defunct> on this machine.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
CGROUP_CONF=/etc/slurm/cgroup.conf
SPOOL=/var/spool/slurm-local
CLUSTER_DIR=${HVDTRAIN_CLUSTER_DIR:-/run/hvdtrain-cluster}
NODES_SPOOL=$CLUSTER_DIR/slurm
NODES_CONF=$NODES_SPOOL/slurm.conf
PACKAGES=(slurmctld slurmd slurm-client munge)
MUNGE_PID=/run/munge/munged.pid

say() { echo "[slurm_local] $*"; }
die() { echo "[slurm_local] error: $*" >&2; exit 1; }
# the pid in file $1 is a live process (a zombie is not)
running() {
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]
}
# stops the daemon whose pid file is $1 and waits for it to end
stop_pidfile() {
    local name=$1 file=$2
    running "$file" || return 0
    say "stopping $name"
    kill "$(cat "$file")" 2>/dev/null || true
    for _ in $(seq 50); do running "$file" || return 0; sleep 0.2; done
    kill -9 "$(cat "$file")" 2>/dev/null || true
}
# closes this shell's descriptors above 2 (run in the subshell that becomes a daemon)
close_fds() {
    local fd
    for fd in $(ls /proc/$BASHPID/fd); do [ "$fd" -le 2 ] || eval "exec $fd>&-" 2>/dev/null || true; done
}
munge_answers() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

install_packages() {
    local missing=()
    for pkg in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$(id -u)" -eq 0 ] || die "missing packages ${missing[*]}: run as root or install them"
    if ! apt-cache show slurmctld >/dev/null 2>&1; then
        say "apt-get update"
        apt-get update -q >/dev/null
    fi
    say "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
}

write_config() {
    local host cpus memory changed=0
    host=$(hostname -s)
    cpus=$(nproc)
    # Memory is a consumable resource and task/cgroup confines each job to what it asked for
    # (--mem, --mem-per-cpu; by default its CPUs' share of the node), as on a production cluster:
    # a job over its limit is killed by the kernel and ends OUT_OF_MEMORY. Slurm's own cgroup v1
    # hierarchy under /sys/fs/cgroup/memory; 1 GiB of the machine left to everything else.
    memory=$(( $(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo) - 1024 ))
    cat >"$CGROUP_CONF.new" <<EOF
# Written by hvdtrain's scripts/slurm_local.sh: jobs confined to the memory they were given.
CgroupPlugin=cgroup/v1
ConstrainRAMSpace=yes
ConstrainSwapSpace=yes
AllowedSwapSpace=0
EOF
    if ! cmp -s "$CGROUP_CONF.new" "$CGROUP_CONF" 2>/dev/null; then
        mv "$CGROUP_CONF.new" "$CGROUP_CONF"
        changed=1
    fi
    rm -f "$CGROUP_CONF.new"
    mkdir -p /etc/slurm "$SPOOL/ctld" "$SPOOL/d" "$SPOOL/log"
    # cred_expire also sets how long a requeued job waits before it may start again (default 120 s;
    # 10 s is still far longer than a credential takes to reach slurmd here).
    cat >"$CONF.new" <<EOF
# Written by hvdtrain's scripts/slurm_local.sh: a one-node cluster for tests.
ClusterName=hvdtrain-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/cgroup
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=$((memory / cpus))
ReturnToService=2
MinJobAge=3600
KillWait=10
SchedulerParameters=sched_interval=5,bf_interval=5
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/d
SlurmctldPidFile=$SPOOL/slurmctld.pid
SlurmdPidFile=$SPOOL/slurmd.pid
SlurmctldLogFile=$SPOOL/log/slurmctld.log
SlurmdLogFile=$SPOOL/log/slurmd.log
NodeName=$host CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    if ! cmp -s "$CONF.new" "$CONF" 2>/dev/null; then
        mv "$CONF.new" "$CONF"
        changed=1
    fi
    rm -f "$CONF.new"
    return "$changed"  # 1: changed, running daemons must restart
}

# A credential round trip, not a process name: a <defunct> munged left by a stop would pass `pgrep`.
start_munge() {
    munge_answers && return 0
    [ -s /etc/munge/munge.key ] || { say "creating the munge key"; mungekey --create --force; }
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 755 /run/munge
    stop_pidfile munged "$MUNGE_PID"  # alive but not answering
    say "starting munged"
    # --force: a socket left by a munged that died would otherwise stop the new one. munged keeps
    # the descriptors it inherits: closed first, or a `flock` held by the caller would never end.
    (close_fds; exec runuser -u munge -- /usr/sbin/munged --force)
    for _ in $(seq 50); do munge_answers && return 0; sleep 0.2; done
    die "munged does not answer (see /var/log/munge/munged.log)"
}

# waits until every node in $1 (a Slurm host list) is idle (down or drained ones are resumed); logs in $2
wait_idle() {
    local nodes=$1 logs=$2 out=""
    for _ in $(seq 120); do
        out=$(sinfo -h -N -n "$nodes" -o '%N %T' 2>/dev/null || true)
        if [ -n "$out" ] && ! grep -qvE ' (idle|mixed|allocated)$' <<<"$out"; then
            say "nodes $nodes: $(awk '{print $2}' <<<"$out" | sort -u | tr '\n' ' ')"
            return 0
        fi
        if grep -qE ' (down|drain|fail)' <<<"$out"; then
            scontrol update NodeName="$nodes" State=RESUME >/dev/null 2>&1 || true
        fi
        sleep 0.5
    done
    die "nodes $nodes not idle after 60 s ($(tr '\n' ' ' <<<"$out")); logs in $logs"
}

stop() {
    stop_pidfile slurmd "$SPOOL/slurmd.pid"
    stop_pidfile slurmctld "$SPOOL/slurmctld.pid"
    # munged serves both clusters: it stays while the other one runs
    if ! running "$NODES_SPOOL/slurmctld.pid"; then stop_pidfile munged "$MUNGE_PID"; fi
}

start() {
    install_packages
    if ! write_config && { running "$SPOOL/slurmctld.pid" || running "$SPOOL/slurmd.pid"; }; then
        say "config changed: restarting the daemons"
        stop_pidfile slurmd "$SPOOL/slurmd.pid"
        stop_pidfile slurmctld "$SPOOL/slurmctld.pid"
    fi
    start_munge
    if ! running "$SPOOL/slurmctld.pid"; then say "starting slurmctld"; slurmctld -f "$CONF"; fi
    if ! running "$SPOOL/slurmd.pid"; then say "starting slurmd"; slurmd -f "$CONF"; fi
    SLURM_CONF=$CONF wait_idle "$(hostname -s)" "$SPOOL/log"
}

status() {
    running "$MUNGE_PID" && munge_answers && echo "munged: running" || echo "munged: stopped"
    for daemon in slurmctld slurmd; do
        if running "$SPOOL/$daemon.pid"; then echo "$daemon: running"; else echo "$daemon: stopped"; fi
    done
    SLURM_CONF=$CONF sinfo 2>&1 || true
}

nodes_count() { cat "$CLUSTER_DIR/nodes" 2>/dev/null || echo 0; }

# The cluster over the namespace nodes: returns 1 when the config changed
write_nodes_config() {
    local n=$1 k host
    host=$(hostname -s)
    mkdir -p "$NODES_SPOOL/ctld" "$NODES_SPOOL/log"
    # slurmd creates none of its per-node folders; PMIx needs a /tmp of each node's own (TmpFS)
    for k in $(seq "$n"); do mkdir -p "$NODES_SPOOL/node$k/spool" "$NODES_SPOOL/node$k/tmp"; done
    {
        cat <<EOF
# Written by hvdtrain's scripts/slurm_local.sh: Slurm over scripts/cluster_local.sh's $n nodes.
ClusterName=hvdtrain-nodes
SlurmctldHost=$host(10.77.0.1)
SlurmctldPort=6827
SlurmdPort=6828
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MinJobAge=3600
KillWait=10
SchedulerParameters=sched_interval=5,bf_interval=5
StateSaveLocation=$NODES_SPOOL/ctld
SlurmdSpoolDir=$NODES_SPOOL/%n/spool
TmpFS=$NODES_SPOOL/%n/tmp
SlurmctldPidFile=$NODES_SPOOL/slurmctld.pid
SlurmdPidFile=$NODES_SPOOL/%n/slurmd.pid
SlurmctldLogFile=$NODES_SPOOL/log/slurmctld.log
SlurmdLogFile=$NODES_SPOOL/%n/slurmd.log
EOF
        # Two CPUs a node (the machine's cores, which the nodes share): room for two tasks on each,
        # as a 2 stages x 2 copies pipeline job on two nodes needs.
        for k in $(seq "$n"); do
            echo "NodeName=node$k NodeAddr=10.77.0.$((10 + k)) NodeHostname=node$k CPUs=2 State=UNKNOWN"
        done
        echo "PartitionName=nodes Nodes=node[1-$n] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
    } >"$NODES_CONF.new"
    if ! cmp -s "$NODES_CONF.new" "$NODES_CONF" 2>/dev/null; then mv "$NODES_CONF.new" "$NODES_CONF"; return 1; fi
    rm -f "$NODES_CONF.new"
}

stop_node_daemons() {
    local dir
    for dir in "$NODES_SPOOL"/node*/; do
        [ -d "$dir" ] && stop_pidfile "slurmd on $(basename "$dir")" "$dir/slurmd.pid"
    done
    stop_pidfile "slurmctld (nodes)" "$NODES_SPOOL/slurmctld.pid"
}

start_nodes() {
    local n k
    install_packages
    n=$(nodes_count)
    [ "$n" -ge 1 ] || die "no namespace nodes: start them first (bash scripts/cluster_local.sh start)"
    if ! write_nodes_config "$n" && running "$NODES_SPOOL/slurmctld.pid"; then
        say "config changed: restarting the nodes' daemons"
        stop_node_daemons
    fi
    start_munge
    if ! running "$NODES_SPOOL/slurmctld.pid"; then say "starting slurmctld (nodes)"; slurmctld -f "$NODES_CONF"; fi
    for k in $(seq "$n"); do
        running "$NODES_SPOOL/node$k/slurmd.pid" && continue
        say "starting slurmd on node$k"
        # nsenter, not `ip netns exec`, which remounts /sys without /sys/fs/cgroup and slurmd stops;
        # its own UTS namespace gives the node its own host name, as with its sshd
        nsenter --net="/run/netns/node$k" unshare --uts sh -c \
            "hostname node$k && exec slurmd -N node$k -f '$NODES_CONF'"
    done
    grep -q SLURM_CONF "$CLUSTER_DIR/env" 2>/dev/null || echo "export SLURM_CONF=$NODES_CONF" >>"$CLUSTER_DIR/env"
    SLURM_CONF=$NODES_CONF wait_idle "node[1-$n]" "$NODES_SPOOL"
}

stop_nodes() {
    stop_node_daemons
    if [ -f "$CLUSTER_DIR/env" ]; then sed -i '/SLURM_CONF/d' "$CLUSTER_DIR/env"; fi
    # munged serves both clusters: it stays while the one-node cluster runs
    if ! running "$SPOOL/slurmctld.pid"; then stop_pidfile munged "$MUNGE_PID"; fi
    rm -rf "${NODES_SPOOL:?}"
}

status_nodes() {
    local dir
    if running "$NODES_SPOOL/slurmctld.pid"; then echo "slurmctld (nodes): running"; else echo "slurmctld (nodes): stopped"; fi
    for dir in "$NODES_SPOOL"/node*/; do
        [ -d "$dir" ] || continue
        if running "$dir/slurmd.pid"; then echo "slurmd on $(basename "$dir"): running"
        else echo "slurmd on $(basename "$dir"): stopped"; fi
    done
    SLURM_CONF=$NODES_CONF sinfo -N 2>&1 || true
}

case "${1:-}:${2:-}" in
    start:) start ;;
    stop:) stop ;;
    status:) status ;;
    start:--nodes) start_nodes ;;
    stop:--nodes) stop_nodes ;;
    status:--nodes) status_nodes ;;
    *) echo "usage: $0 start|stop|status [--nodes]" >&2; exit 2 ;;
esac
