#!/usr/bin/env bash
# A cluster of N nodes on this machine: each node is a network namespace (node1, node2, ...) with its
# own address on a private bridge, its own host name and its own sshd, so that horovodrun, mpirun and
# Slurm start ranks on the nodes over ssh and TCP exactly as on a real cluster.
#   bash scripts/cluster_local.sh start [N] [--bandwidth RATE]   create or check N nodes (default 2);
#                                   RATE (e.g. 10gbit, 1gbit, 100mbit, or "none") shapes every node's link
#   bash scripts/cluster_local.sh stop                           stop everything started here, remove it
#   bash scripts/cluster_local.sh status                         nodes, links, sshd, ssh round trip
#   bash scripts/cluster_local.sh link K down|up                 cut or mend node K's link (tests)
#   bash scripts/cluster_local.sh sshd K stop|start              stop or start node K's sshd (tests)
# Needs root and iproute2; installs openssh-server when missing. Nothing in ~/.ssh is read or changed:
# the cluster's keys and ssh config live in $HVDTRAIN_CLUSTER_DIR (default /run/hvdtrain-cluster), and
# `source $HVDTRAIN_CLUSTER_DIR/env` puts a wrapper `ssh` (plain ssh with the cluster's -F) first on PATH,
# which is the `ssh` that horovodrun and Open MPI call. /etc/hosts gets one line per node, marked for
# removal. Idempotent: `start` on a running cluster only checks and repairs it.
set -euo pipefail

DIR=${HVDTRAIN_CLUSTER_DIR:-/run/hvdtrain-cluster}
BRIDGE=br-hvd
SUBNET=10.77.0
MARK="# hvdtrain-cluster"

say() { echo "[cluster_local] $*"; }
die() { echo "[cluster_local] error: $*" >&2; exit 1; }
node_ip() { echo "$SUBNET.$((10 + $1))"; }
# the root side of node K's link; the side inside the node is named like the bridge, because Horovod
# gives every rank the launcher's interface name
veth() { echo "vhvd-node$1"; }
nodes_started() { cat "$DIR/nodes" 2>/dev/null || echo 0; }
# the highest node whose link exists, for a stop after the state folder was lost
nodes_linked() { ip -o link show 2>/dev/null | sed -n 's/^[0-9]*: vhvd-node\([0-9]*\)@.*/\1/p' | sort -n | tail -1; }
# running, not a zombie: this machine's init may leave a killed daemon <defunct> for a long while
pid_alive() {
    [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]
}
sshd_pid() { cat "$DIR/node$1/sshd.pid" 2>/dev/null || true; }

install_packages() {
    [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, bridge, /etc/hosts)"
    command -v ip >/dev/null || die "iproute2 (ip) is missing"
    [ -x /usr/sbin/sshd ] && return 0
    if ! apt-cache show openssh-server >/dev/null 2>&1; then apt-get update -q >/dev/null; fi
    say "installing openssh-server"
    # policy-rc.d or no init system: the package's own sshd is not started here, and none is needed
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openssh-server >/dev/null
}

write_ssh_files() {
    local n=$1 k hosts=""
    mkdir -p "$DIR/ssh" "$DIR/bin" /run/sshd
    chmod 700 "$DIR/ssh"
    [ -s "$DIR/ssh/id_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -C hvdtrain-cluster -f "$DIR/ssh/id_ed25519"
    [ -s "$DIR/ssh/host_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -C hvdtrain-cluster-host -f "$DIR/ssh/host_ed25519"
    chmod 600 "$DIR/ssh/id_ed25519" "$DIR/ssh/host_ed25519"
    cp "$DIR/ssh/id_ed25519.pub" "$DIR/ssh/authorized_keys"
    for k in $(seq "$n"); do hosts="$hosts node$k $(node_ip "$k")"; done
    # Fail fast and never prompt: a node that does not answer must end the launch, not hang it.
    # Other hosts keep the user's own settings.
    cat >"$DIR/ssh/ssh_config" <<EOF
# Written by hvdtrain's scripts/cluster_local.sh for the local cluster's nodes.
Host$hosts
    IdentityFile $DIR/ssh/id_ed25519
    IdentitiesOnly yes
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    BatchMode yes
    ConnectTimeout 5
    ServerAliveInterval 2
    ServerAliveCountMax 3
Host *
    Include ~/.ssh/config
    Include /etc/ssh/ssh_config
EOF
    cat >"$DIR/bin/ssh" <<EOF
#!/bin/sh
# hvdtrain's local cluster: plain ssh with the cluster's config (horovodrun and mpirun call \`ssh\`).
exec /usr/bin/ssh -F $DIR/ssh/ssh_config "\$@"
EOF
    chmod 755 "$DIR/bin/ssh"
    cat >"$DIR/env" <<EOF
# source this file to use hvdtrain's local cluster: its ssh wrapper first on PATH
export PATH="$DIR/bin:\${PATH}"
export HVDTRAIN_CLUSTER_DIR="$DIR"
EOF
}

start_bridge() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        say "creating bridge $BRIDGE ($SUBNET.1/24)"
        ip link add "$BRIDGE" type bridge
    fi
    ip addr replace "$SUBNET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
}

start_node() {
    local k=$1 ns="node$1" ip
    ip=$(node_ip "$k")
    mkdir -p "$DIR/$ns"
    ip netns list | grep -qw "^$ns" || { say "creating $ns ($ip)"; ip netns add "$ns"; }
    if ! ip link show "$(veth "$k")" >/dev/null 2>&1; then
        ip netns exec "$ns" ip link del "$BRIDGE" 2>/dev/null || true
        ip link add "$(veth "$k")" type veth peer name "$BRIDGE" netns "$ns"
        ip link set "$(veth "$k")" master "$BRIDGE"
    fi
    ip link set "$(veth "$k")" up
    ip netns exec "$ns" ip addr replace "$ip/24" dev "$BRIDGE"
    ip netns exec "$ns" ip link set "$BRIDGE" up
    ip netns exec "$ns" ip link set lo up
    start_sshd "$k"
}

start_sshd() {
    local k=$1 ns="node$1"
    pid_alive "$(sshd_pid "$k")" && return 0
    cat >"$DIR/$ns/sshd_config" <<EOF
# Written by hvdtrain's scripts/cluster_local.sh: the sshd of $ns.
ListenAddress $(node_ip "$k")
HostKey $DIR/ssh/host_ed25519
PidFile $DIR/$ns/sshd.pid
AuthorizedKeysFile $DIR/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes no
UsePAM no
PrintMotd no
X11Forwarding no
MaxStartups 64:30:128
# sessions on a node find the cluster's ssh wrapper first, as the launcher does: node-to-node ssh works
SetEnv PATH=$DIR/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
EOF
    say "starting sshd on $ns"
    # its own UTS namespace: each node has its own host name, which Horovod's Gloo falls back to
    ip netns exec "$ns" unshare --uts sh -c \
        "hostname $ns && exec /usr/sbin/sshd -f '$DIR/$ns/sshd_config' -E '$DIR/$ns/sshd.log'"
    for _ in $(seq 50); do pid_alive "$(sshd_pid "$k")" && return 0; sleep 0.1; done
    die "sshd on $ns did not start (see $DIR/$ns/sshd.log)"
}

write_hosts() {
    local n=$1 k tmp
    tmp=$(mktemp)
    grep -v -- "$MARK\$" /etc/hosts >"$tmp" || true
    for k in $(seq "$n"); do echo "$(node_ip "$k") node$k $MARK" >>"$tmp"; done
    # rewritten in place: /etc/hosts may be a bind mount that a rename would not replace
    cat "$tmp" >/etc/hosts
    rm -f "$tmp"
}

# tbf needs a bucket of at least one timer tick's worth of bytes: 10 ms of the rate, and never below 64 KiB
burst_for() {
    local rate=$1 num unit bits
    num=${rate%%[a-zA-Z]*}
    unit=${rate#"$num"}
    case "${unit,,}" in
        gbit) bits=$((num * 1000000000)) ;;
        mbit) bits=$((num * 1000000)) ;;
        kbit) bits=$((num * 1000)) ;;
        bit|"") bits=$num ;;
        *) die "bandwidth '$rate': use a number with gbit, mbit or kbit (e.g. 1gbit)" ;;
    esac
    local bytes=$((bits / 8 / 100))
    [ "$bytes" -ge 65536 ] || bytes=65536
    echo "$bytes"
}

shape() {
    local n=$1 rate=$2 k burst=""
    [ "$rate" = none ] || burst=$(burst_for "$rate")
    for k in $(seq "$n"); do
        ip netns exec "node$k" tc qdisc del dev "$BRIDGE" root 2>/dev/null || true
        [ "$rate" = none ] && continue
        ip netns exec "node$k" tc qdisc add dev "$BRIDGE" root tbf rate "$rate" burst "$burst" latency 50ms
    done
    say "links: ${rate/none/unshaped}"
}

wait_ssh() {
    local n=$1 k
    for k in $(seq "$n"); do
        for _ in $(seq 50); do
            [ "$("$DIR/bin/ssh" "node$k" hostname 2>/dev/null)" = "node$k" ] && continue 2
            sleep 0.2
        done
        die "ssh node$k does not answer (see $DIR/node$k/sshd.log)"
    done
    say "$n nodes answer over ssh: $(seq -s ' ' -f 'node%g' "$n")"
}

stop_node() {
    local k=$1 ns="node$1" pid
    if ip netns list | grep -qw "^$ns"; then
        # every process inside the node (sshd's sessions, ranks, slurmd), by PID
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill "$pid" 2>/dev/null || true; done
        for _ in $(seq 30); do [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && break; sleep 0.1; done
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    fi
    pid=$(sshd_pid "$k")
    if pid_alive "$pid"; then kill "$pid" 2>/dev/null || true; fi
    ip link del "$(veth "$k")" 2>/dev/null || true
    if ip netns list | grep -qw "^$ns"; then say "removing $ns"; ip netns del "$ns"; fi
    rm -rf "${DIR:?}/$ns"
}

stop() {
    local n k
    # Slurm over the nodes first (scripts/slurm_local.sh start --nodes): its slurmctld lives outside them
    if [ -d "$DIR/slurm" ]; then bash "$(dirname "$0")/slurm_local.sh" stop --nodes; fi
    n=$(nodes_started)
    k=$(nodes_linked)
    [ "${k:-0}" -le "$n" ] || n=$k
    for k in $(seq "$n"); do stop_node "$k"; done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then say "removing bridge $BRIDGE"; ip link del "$BRIDGE"; fi
    if grep -q -- "$MARK\$" /etc/hosts; then write_hosts 0; fi
    rm -rf "${DIR:?}"
    say "stopped"
}

start() {
    local n=$1 rate=$2 k old
    install_packages
    old=$(nodes_started)
    for k in $(seq $((n + 1)) "$old"); do stop_node "$k"; done  # fewer nodes than last time
    write_ssh_files "$n"
    echo "$n" >"$DIR/nodes"
    start_bridge
    for k in $(seq "$n"); do start_node "$k"; done
    write_hosts "$n"
    [ -z "$rate" ] || shape "$n" "$rate"
    wait_ssh "$n"
    say "ready: source $DIR/env (ssh wrapper first on PATH)"
}

status() {
    local n k ok=0 link qdisc
    n=$(nodes_started)
    [ "$n" -gt 0 ] || { echo "no cluster started"; return 1; }
    for k in $(seq "$n"); do
        link=$(ip -br link show "$(veth "$k")" 2>/dev/null | awk '{print $2}')
        qdisc=$(ip netns exec "node$k" tc qdisc show dev "$BRIDGE" 2>/dev/null | awk '/tbf/ {print $8}')
        if [ "$("$DIR/bin/ssh" "node$k" hostname 2>/dev/null)" = "node$k" ]; then
            echo "node$k $(node_ip "$k") link ${link:-missing} rate ${qdisc:-unshaped} ssh ok"
        else
            echo "node$k $(node_ip "$k") link ${link:-missing} rate ${qdisc:-unshaped} ssh FAILED"; ok=1
        fi
    done
    return "$ok"
}

node_arg() {
    [[ "${1:-}" =~ ^[0-9]+$ ]] && [ "$1" -ge 1 ] && [ "$1" -le "$(nodes_started)" ] \
        || die "no node '${1:-}' in the running cluster (nodes 1..$(nodes_started))"
}

main() {
    local cmd=${1:-} n=2 rate=""
    shift || true
    case "$cmd" in
        start)
            while [ $# -gt 0 ]; do
                case "$1" in
                    --bandwidth) rate=${2:?--bandwidth needs a rate}; shift 2 ;;
                    --bandwidth=*) rate=${1#*=}; shift ;;
                    [0-9]*) n=$1; shift ;;
                    *) die "unknown argument '$1'" ;;
                esac
            done
            [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "N must be between 1 and 200"
            start "$n" "$rate" ;;
        stop) stop ;;
        status) status ;;
        link)
            node_arg "${1:-}"
            case "${2:-}" in down|up) ip link set "$(veth "$1")" "$2" ;; *) die "link K down|up" ;; esac ;;
        sshd)
            node_arg "${1:-}"
            case "${2:-}" in
                stop) pid_alive "$(sshd_pid "$1")" && kill "$(sshd_pid "$1")"; rm -f "$DIR/node$1/sshd.pid" ;;
                start) start_sshd "$1" ;;
                *) die "sshd K stop|start" ;;
            esac ;;
        *) echo "usage: $0 start [N] [--bandwidth RATE] | stop | status | link K down|up | sshd K stop|start" >&2
           exit 2 ;;
    esac
}

main "$@"
