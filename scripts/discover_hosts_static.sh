#!/bin/sh
# Host discovery for elastic hvdtrain (horovodrun --host-discovery-script): a fixed list of hosts,
# one "host:slots" per line. The default is this machine under two names, which Horovod counts as
# two hosts, so that elastic mode runs on one machine without ssh; set HVDTRAIN_HOSTS to override
# (space-separated, e.g. "node1:4 node2:4").
for host in ${HVDTRAIN_HOSTS:-localhost:1 127.0.0.1:1}; do
    echo "$host"
done
