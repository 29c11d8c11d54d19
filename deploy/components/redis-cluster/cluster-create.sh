#!/bin/sh
# Creates the gallery's Redis Cluster once: 3 primaries with 1 replica each from 6 empty nodes.
#
#   sh cluster-create.sh [HOST:PORT ...]
#
# The nodes are the arguments, or else SPHEREFACE_REDIS_CLUSTER (comma-separated HOST:PORT, the
# list the service gets). The script
#   1. waits until every node answers PING (CLUSTER_WAIT_SECONDS, default 300);
#   2. creates nothing when any node already belongs to a cluster (it knows another node or holds
#      slots): it prints that cluster's state and exits 0 once that node reports cluster_state:ok
#      (1 when it does not in time), so running it again is harmless;
#   3. otherwise runs redis-cli --cluster create with --cluster-replicas CLUSTER_REPLICAS
#      (default 1) and waits until every node reports cluster_state:ok.
# A node that is empty while the others form a cluster is named, with the redis-cli command that
# adds it; the script does not add it. REDISCLI_AUTH, when set, is the password redis-cli sends.
# Kubernetes (deploy/components/redis-cluster) and docker/compose.cluster.yaml both run this file.
set -eu

wait_seconds=${CLUSTER_WAIT_SECONDS:-300}
replicas=${CLUSTER_REPLICAS:-1}
deadline=$(($(date +%s) + wait_seconds))

cli() { # HOST:PORT ARGS...: redis-cli against that node
    host=${1%:*}
    port=${1##*:}
    shift
    redis-cli -h "$host" -p "$port" "$@"
}

info_field() { # NODE FIELD: FIELD's value in the node's CLUSTER INFO
    cli "$1" cluster info | tr -d '\r' | sed -n "s/^$2://p"
}

in_time() { # true until the deadline
    [ "$(date +%s)" -lt "$deadline" ]
}

wait_for_ping() {
    for node in "$@"; do
        until [ "$(cli "$node" ping 2>/dev/null)" = PONG ]; do
            in_time || { echo "cluster-create: $node does not answer PING after $wait_seconds s" >&2; exit 1; }
            sleep 1
        done
    done
}

is_member() { # NODE: the node knows other nodes or holds slots
    [ "$(info_field "$1" cluster_known_nodes)" -gt 1 ] || [ "$(info_field "$1" cluster_slots_assigned)" -gt 0 ]
}

wait_for_state_ok() {
    for node in "$@"; do
        until [ "$(info_field "$node" cluster_state)" = ok ]; do
            in_time || { echo "cluster-create: $node is not cluster_state:ok after $wait_seconds s" >&2; exit 1; }
            sleep 1
        done
    done
}

report_existing() { # MEMBER NODES...: say what exists, name the nodes outside it, wait for ok
    member=$1
    shift
    echo "cluster-create: $member already belongs to a cluster; nothing to create"
    for node in "$@"; do
        is_member "$node" ||
            echo "cluster-create: $node is empty and outside the cluster; to add it as a replica:" \
                "redis-cli --cluster add-node $node $member --cluster-slave" >&2
    done
    wait_for_state_ok "$member"
    cli "$member" cluster info | tr -d '\r' | grep -E '^cluster_(state|known_nodes|size):'
}

if [ "$#" -eq 0 ]; then
    # shellcheck disable=SC2086 # split the comma-separated list into arguments
    set -- $(echo "${SPHEREFACE_REDIS_CLUSTER:-}" | tr ',' ' ')
fi
[ "$#" -gt 0 ] || { echo "cluster-create: give the nodes as HOST:PORT arguments or in SPHEREFACE_REDIS_CLUSTER" >&2; exit 2; }

wait_for_ping "$@"
for node in "$@"; do
    if is_member "$node"; then
        report_existing "$node" "$@"
        exit 0
    fi
done
redis-cli --cluster create "$@" --cluster-replicas "$replicas" --cluster-yes
wait_for_state_ok "$@"
echo "cluster-create: created a cluster of $# nodes, $replicas replica(s) per primary"
