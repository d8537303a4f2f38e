#!/bin/sh
# Host discovery for elastic hvdtrain (horovodrun --host-discovery-script): prints the hosts listed
# in a file, one "host:slots" per line ('#' starts a comment). Horovod runs this every few seconds,
# so editing the file while the job runs adds hosts (they join at the next commit) or removes them.
# The file is $HVDTRAIN_HOSTS_FILE (default: hosts.txt in the current directory).
file=${HVDTRAIN_HOSTS_FILE:-hosts.txt}
[ -r "$file" ] || exit 0
sed -e 's/#.*//' -e 's/[[:space:]]//g' "$file" | grep -v '^$'
