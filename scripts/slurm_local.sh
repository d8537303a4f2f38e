#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for hvdtrain's Slurm tests and for trying `hvdtrain slurm`.
#   bash scripts/slurm_local.sh start    install (Debian packages, when missing), configure, start, wait
#   bash scripts/slurm_local.sh stop     stop the daemons started here
#   bash scripts/slurm_local.sh status   the daemons and `sinfo`
# Needs root (Debian 12: slurmctld, slurmd, slurm-client and munge 22.05). Idempotent: `start` on a
# running cluster only checks it. Config: /etc/slurm/slurm.conf; state and logs under /var/spool/slurm-local.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
SPOOL=/var/spool/slurm-local
PACKAGES=(slurmctld slurmd slurm-client munge)

say() { echo "[slurm_local] $*"; }
die() { echo "[slurm_local] error: $*" >&2; exit 1; }
running() { pgrep -x "$1" >/dev/null 2>&1; }

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
    local host cpus
    host=$(hostname -s)
    cpus=$(nproc)
    mkdir -p /etc/slurm "$SPOOL/ctld" "$SPOOL/d" "$SPOOL/log"
    # cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
    cat >"$CONF.new" <<EOF
# Written by hvdtrain's scripts/slurm_local.sh: a one-node cluster for tests.
ClusterName=hvdtrain-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=30
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
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/d
SlurmctldPidFile=$SPOOL/slurmctld.pid
SlurmdPidFile=$SPOOL/slurmd.pid
SlurmctldLogFile=$SPOOL/log/slurmctld.log
SlurmdLogFile=$SPOOL/log/slurmd.log
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    if ! cmp -s "$CONF.new" "$CONF" 2>/dev/null; then
        mv "$CONF.new" "$CONF"
        return 1  # changed: running daemons must restart
    fi
    rm -f "$CONF.new"
}

start_munge() {
    running munged && return 0
    [ -s /etc/munge/munge.key ] || { say "creating the munge key"; mungekey --create --force; }
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 755 /run/munge
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge -n </dev/null | unmunge >/dev/null 2>&1 && return 0; sleep 0.2; done
    die "munged does not answer (see /var/log/munge/munged.log)"
}

wait_idle() {
    local host state
    host=$(hostname -s)
    for _ in $(seq 120); do
        state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
        case "$state" in
            idle*|mixed*|allocated*) say "node $host is $state"; return 0 ;;
            down*|drain*) scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true ;;
        esac
        sleep 0.5
    done
    die "node $host not idle after 60 s (state '$state'); logs in $SPOOL/log"
}

stop() {
    for daemon in slurmd slurmctld; do
        if running "$daemon"; then say "stopping $daemon"; kill "$(pgrep -x "$daemon")" || true; fi
    done
    for _ in $(seq 50); do running slurmd || running slurmctld || break; sleep 0.2; done
    if running munged; then say "stopping munged"; kill "$(pgrep -x munged)" || true; fi
}

start() {
    install_packages
    if ! write_config && { running slurmctld || running slurmd; }; then
        say "config changed: restarting the daemons"
        stop
    fi
    start_munge
    if ! running slurmctld; then say "starting slurmctld"; slurmctld; fi
    if ! running slurmd; then say "starting slurmd"; slurmd; fi
    wait_idle
}

status() {
    for daemon in munged slurmctld slurmd; do
        if running "$daemon"; then echo "$daemon: running"; else echo "$daemon: stopped"; fi
    done
    sinfo 2>&1 || true
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
