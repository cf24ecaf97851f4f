#!/usr/bin/env bash
# A rate-limited link between two network namespaces, for benchmarks and the demo that must
# be network-bound rather than bound by a 2-core loopback. Python tools run it through
# lynx.tools.netlink, which names the two sides (test/unit/test_netlink_tool.py keeps its
# names and addresses equal to NS_A/NS_B/IP_A/IP_B below).
#
#   scripts/netlink.sh up [RATE]   create lynx-a (10.77.0.1) <-veth-> lynx-b (10.77.0.2),
#                                  each direction limited to RATE by tbf (default 1gbit)
#   scripts/netlink.sh rate RATE   change both directions' limit on a link that is up;
#                                  RATE none: no limit (veth at memory speed)
#   scripts/netlink.sh down        delete both namespaces (and with them the veth pair)
#   scripts/netlink.sh status      show the namespaces, addresses and qdiscs
#
# Run a process on one side with `ip netns exec lynx-a CMD`. Needs root and iproute2.
# Rate limiting only: this kernel has no netem, so no added delay (RTT stays ~loopback).
# `up` deletes a previous link first; `down` is idempotent. Nothing in the root
# namespace is touched.
set -euo pipefail

NS_A=lynx-a
NS_B=lynx-b
IP_A=10.77.0.1
IP_B=10.77.0.2
BURST=${LYNX_TBF_BURST:-32kb}  # small: a larger bucket lets a whole Anchor pass at line rate

down() {
    for ns in "$NS_A" "$NS_B"; do
        if ip netns list | grep -qw "$ns"; then
            ip netns delete "$ns"
        fi
    done
}

up() {
    local rate=${1:-1gbit}
    down
    ip netns add "$NS_A"
    ip netns add "$NS_B"
    trap 'down' ERR
    ip -n "$NS_A" link add veth-a type veth peer name veth-b netns "$NS_B"
    ip -n "$NS_A" addr add "$IP_A/24" dev veth-a
    ip -n "$NS_B" addr add "$IP_B/24" dev veth-b
    for ns_dev in "$NS_A:veth-a" "$NS_B:veth-b"; do
        local ns=${ns_dev%%:*} dev=${ns_dev##*:}
        ip -n "$ns" link set lo up
        ip -n "$ns" link set "$dev" up
    done
    set_rate "$rate"
    trap - ERR
}

set_rate() {
    local rate=$1
    for ns_dev in "$NS_A:veth-a" "$NS_B:veth-b"; do
        local ns=${ns_dev%%:*} dev=${ns_dev##*:}
        if [ "$rate" = none ]; then
            tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
        else
            # burst: at least one MTU-sized packet per timer tick at this rate; latency bounds
            # the queue (bytes beyond rate*latency are dropped, TCP backs off).
            tc -n "$ns" qdisc replace dev "$dev" root tbf rate "$rate" burst "$BURST" latency 50ms
        fi
    done
}

status() {
    for ns in "$NS_A" "$NS_B"; do
        echo "== $ns"
        ip -n "$ns" -br addr 2>/dev/null || echo "(absent)"
        tc -n "$ns" qdisc show 2>/dev/null | grep tbf || true
    done
}

case "${1:-}" in
    up) up "${2:-}" ;;
    rate) set_rate "${2:?usage: $0 rate RATE|none}" ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up [RATE] | rate RATE|none | down | status" >&2; exit 2 ;;
esac
