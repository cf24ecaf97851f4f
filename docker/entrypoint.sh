#!/bin/sh
# Container entrypoint: advertise this container's address to Mooncake and the peers,
# optionally rate-limit the container's link (LYNX_LINK_RATE, e.g. 20mbit: needs root
# and NET_ADMIN, see docker/compose.slowlink.yaml), then run the command as `lynx`.
set -eu
if [ -z "${SGLANG_HOST_IP:-}" ]; then
    SGLANG_HOST_IP=$(python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')
    export SGLANG_HOST_IP
fi
if [ -n "${LYNX_LINK_RATE:-}" ]; then
    dev=${LYNX_LINK_DEV:-eth0}
    tc qdisc replace dev "$dev" root tbf rate "$LYNX_LINK_RATE" burst 32kbit latency 400ms
    echo "lynx-entrypoint: $dev egress limited to $LYNX_LINK_RATE" >&2
fi
if [ "$(id -u)" = 0 ] && id lynx >/dev/null 2>&1; then
    # setpriv keeps the environment: HOME must follow, or caches land in root's home.
    HOME=$(getent passwd lynx | cut -d: -f6) USER=lynx LOGNAME=lynx \
        exec setpriv --reuid=lynx --regid=lynx --init-groups -- "$@"
fi
exec "$@"
