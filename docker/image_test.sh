#!/usr/bin/env bash
# make image-test: build the CPU image here and check it (root, network, about 2 minutes; not part
# of make test). What works on machines that cannot start containers: a Debian base built
# with debootstrap, `buildah bud`, and commands run inside the image with `buildah run` (no
# container can be started). Inside the image it starts the service against a redis-server on
# this machine and asks /readyz and a /v1/verify of two real photos; it prints the image sizes,
# the time from start to ready, and that the serving image holds no torch, no training code and no
# matplotlib, and that its `sphereface` offers the service's commands and none of training's.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared}
IMAGE=${IMAGE:-sphereface:cpu}
PORT=${PORT:-18765}
PHOTOS="$SHARED/data/photos/people/obama"

need() { command -v "$1" >/dev/null 2>&1; }
if ! need buildah || ! need podman || ! need debootstrap; then
  echo "installing buildah, podman and debootstrap with apt-get"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah podman debootstrap
fi
test -f models/dlib_resnet_v1/model.onnx || { echo "run make install first (the default model)" >&2; exit 1; }
test -d "$PHOTOS" || { echo "missing $PHOTOS (real photos for the verify check)" >&2; exit 1; }

# 1. A Debian bookworm base, tagged with the name the Dockerfile expects (no registry here).
if ! podman image exists docker.io/library/debian:bookworm-slim; then
  rootfs=$(mktemp -d)
  mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  debootstrap --variant=minbase bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >/dev/null
  tar -C "$rootfs" -c . | podman import - localhost/debian-min:bookworm >/dev/null
  podman tag localhost/debian-min:bookworm docker.io/library/debian:bookworm-slim
  rm -rf "$rootfs"
fi

# 2. Build (pip reaches PyPI through this machine's CA, given as a build secret, never a layer).
start=$(date +%s)
buildah bud --isolation chroot --format docker --quiet --secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt \
  -f docker/Dockerfile -t "$IMAGE" . >/dev/null
echo "built $IMAGE in $(( $(date +%s) - start )) s"
podman images --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E 'sphereface|debian' || true

# 3. Inside the image: no torch, the service starts against a Redis here, answers readyz and verify.
redis_dir=$(mktemp -d /tmp/sfimgXXXX)
redis-server --port "$((PORT + 1))" --bind 127.0.0.1 --dir "$redis_dir" --appendonly yes \
  --save "" --daemonize yes --pidfile "$redis_dir/redis.pid" >/dev/null
container=$(buildah from "$IMAGE")
cleanup() {
  [ -n "${serve_pid:-}" ] && kill "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null || true
  buildah rm "$container" >/dev/null 2>&1 || true
  kill "$(cat "$redis_dir/redis.pid")" 2>/dev/null || true
  rm -rf "$redis_dir"
}
trap cleanup EXIT
buildah run --isolation chroot "$container" -- python3 -c "
import importlib.util as u
found = [m for m in ('torch', 'training', 'matplotlib') if u.find_spec(m) is not None]
assert not found, found
print('no torch, no training package, no matplotlib in the serving image')"
commands=$(buildah run --isolation chroot "$container" -- sphereface --help)
echo "$commands" | grep -qE '^ +serve ' && ! echo "$commands" | grep -qE '^ +(train|prepare|evaluate) ' \
  || { echo "sphereface in the image should offer serve and no training command:"; echo "$commands"; exit 1; }
echo "sphereface in the image: $(echo "$commands" | awk '/^    [a-z]/{print $1}' | tr '\n' ' ')"
buildah run --isolation chroot "$container" -- python3 -c \
  "import os; assert os.getuid() == 10001, os.getuid(); print('runs as uid', os.getuid())"
started=$(date +%s.%N)
buildah run --isolation chroot \
  --env REDIS_URL="redis://127.0.0.1:$((PORT + 1))/0" --env SPHEREFACE_API_KEY= \
  --env SPHEREFACE_PORT=$PORT --env SPHEREFACE_HOST=127.0.0.1 \
  "$container" -- sphereface serve > "$redis_dir/serve.log" 2>&1 &
serve_pid=$!
for _ in $(seq 1 300); do
  if curl -sf "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1; then break; fi
  sleep 0.2
done
curl -sf "http://127.0.0.1:$PORT/readyz" || { echo "not ready; the log:"; cat "$redis_dir/serve.log"; exit 1; }
echo
echo "ready $(python3 -c "print(f'{$(date +%s.%N) - $started:.1f}')") s after start"
# no key was given (as compose starts it by default): the first start made one in /data/admin.key
KEY=$(buildah run --isolation chroot "$container" -- cat /data/admin.key)
echo "the first start wrote an admin key to /data/admin.key (id ${KEY:4:12})"
answer=$(curl -sf -H "X-API-Key: $KEY" -F photo1=@"$PHOTOS/1.jpg" -F photo2=@"$PHOTOS/2.jpg" \
  "http://127.0.0.1:$PORT/v1/verify")
echo "$answer" | python3 -c "
import json, sys
a = json.load(sys.stdin)
print(f'verify obama 1 vs 2: score {a[\"score\"]:.3f}, same_person {a[\"same_person\"]}')
assert a['same_person'] is True, a"
# SIGTERM (what docker stop and Kubernetes send): requests in flight finish, then exit status 0.
inner=$(pgrep -n -f "sphereface serve" || true)
[ -n "$inner" ] && kill -TERM "$inner"
status=0; wait "$serve_pid" || status=$?
serve_pid=
grep -q "stopped on SIGTERM" "$redis_dir/serve.log" && [ "$status" = 0 ] \
  || { echo "no clean stop on SIGTERM (status $status); the log:"; tail -20 "$redis_dir/serve.log"; exit 1; }
echo "stopped cleanly on SIGTERM (exit status 0)"
echo "image-test passed"
