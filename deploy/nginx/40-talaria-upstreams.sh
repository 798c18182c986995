#!/bin/sh
# nginx image entrypoint hook: render the router upstream list from ROUTER_UPSTREAMS ("host:port host:port").
set -eu
: "${ROUTER_UPSTREAMS:?set ROUTER_UPSTREAMS to the routers' host:port list}"
out=/etc/nginx/conf.d/upstreams.inc
: > "$out"
for u in $ROUTER_UPSTREAMS; do
  echo "server $u max_fails=2 fail_timeout=5s;" >> "$out"
done
