#!/bin/bash
# Host discovery for Horovod elastic mode inside a Slurm allocation: slurm/elastic.sbatch
# runs it from where the package is installed.
# Prints `host:slots` for every node of the job that Slurm still considers usable: a node that is
# down, drained, failing or not responding (a `*` after its state) drops out, and so does any host
# named in the file $HVDTRAIN_EXCLUDE_HOSTS (one per line), which lets an operator take a node out
# by hand. Slots come from $HVDTRAIN_SLOTS_PER_HOST (set by the job script), else
# $SLURM_NTASKS_PER_NODE, else 1.
set -euo pipefail
slots=${HVDTRAIN_SLOTS_PER_HOST:-${SLURM_NTASKS_PER_NODE:-1}}
exclude=${HVDTRAIN_EXCLUDE_HOSTS:-}
for host in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
    if [ -n "$exclude" ] && [ -f "$exclude" ] && grep -qx "$host" "$exclude"; then
        continue
    fi
    state=$(sinfo -h -n "$host" -o %T 2>/dev/null | head -n 1)
    case "$state" in
        *down* | *drain* | *fail* | *'*' | '') continue ;;
    esac
    echo "$host:$slots"
done
