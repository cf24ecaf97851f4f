#!/usr/bin/env bash
# The README's set-up on a bare Debian 12: debootstrap a minimal bookworm (python3.11 and
# its standard library only: no venv module, no headers, no compiler, no sudo), copy this
# checkout's committed files into it, and run there, as root in a chroot, what the README
# says a new user runs: scripts/demo.sh (it installs everything, then runs the main job).
# Prints a summary: wall times, the venv's disk use, the demo's answer and its TTFT.
#
#   sudo scripts/fresh_debian_check.sh [--keep]     ~25 GB free, 15-30 min on 2 cores
#
# The root is made anew under $LYNX_FRESH_ROOT (default /var/tmp/lynx-fresh-debian) and
# removed at the end unless --keep. The host's pip settings (its index and CA bundle) and
# resolver go in, so the chroot reaches what the host reaches. A chroot, not a container:
# it needs no docker daemon (none runs on the hosts this was written on).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "fresh_debian_check: needs root (debootstrap, chroot)" >&2; exit 2; }
keep=${1:-}
root=${LYNX_FRESH_ROOT:-/var/tmp/lynx-fresh-debian}
mirror=${LYNX_DEBIAN_MIRROR:-http://deb.debian.org/debian}
started=$(date +%s)

command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null

mounted=()
cleanup() {
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}" 2>/dev/null || true; done
    [ "$keep" = --keep ] || rm -rf "$root"
}
trap cleanup EXIT

rm -rf "$root"
echo "fresh_debian_check: debootstrap bookworm (minbase + python3.11) into $root"
debootstrap --variant=minbase --include=python3.11,ca-certificates bookworm "$root" "$mirror" >"$root.log" 2>&1 \
    || { tail -n 20 "$root.log" >&2; exit 1; }
boot_s=$(($(date +%s) - started))

for fs in proc sys dev dev/pts; do
    mount --bind "/$fs" "$root/$fs"
    mounted+=("$root/$fs")
done
mkdir -p "$root/dev/shm" && mount -t tmpfs shm "$root/dev/shm" && mounted+=("$root/dev/shm")
cp /etc/resolv.conf "$root/etc/resolv.conf"
[ -f /etc/pip.conf ] && cp /etc/pip.conf "$root/etc/pip.conf"
# The host's CA bundle: where a proxy on the way re-signs TLS, only the host's bundle has its CA.
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
for dir in /opt/wheels /opt/pypi /opt/pypi-more; do  # this host's local package indexes, if any
    if [ -d "$dir" ]; then mkdir -p "$root$dir" && mount --bind "$dir" "$root$dir" && mounted+=("$root$dir"); fi
done
mkdir -p "$root/lynx"
git ls-files -z | tar --null -T - -cf - | tar -C "$root/lynx" -xf -

echo "fresh_debian_check: scripts/demo.sh in the chroot (install, then the main job)"
demo_started=$(date +%s)
set +e
chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
    /bin/bash -c "cd /lynx && scripts/demo.sh" >"$root.demo.log" 2>&1
status=$?
set -e
demo_s=$(($(date +%s) - demo_started))
venv=$(du -sh "$root/lynx/.venv" 2>/dev/null | cut -f1 || echo none)
echo "---- summary"
echo "debootstrap ${boot_s} s; install + demo ${demo_s} s; .venv ${venv}; exit status ${status}"
grep -E "^(install:|TTFT|Answer|answer)" "$root.demo.log" | head -n 20 || true
[ "$status" -eq 0 ] || { echo "---- the demo's last lines"; tail -n 30 "$root.demo.log"; }
exit "$status"
