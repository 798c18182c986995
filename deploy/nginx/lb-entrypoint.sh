#!/bin/sh
# Load balancer entrypoint (compose `entrypoint`, Nomad task): render nginx.conf.template with the routers'
# address and this container's DNS resolver, then exec nginx (PID 1 after the exec: it gets the signals).
#   ROUTER_UPSTREAM  host:port of a DNS name that resolves to every router (compose: the network alias
#                    talaria-routers; Nomad/Consul: the service's DNS name)
#   LB_PORT          listening port (default 8080)
#   LB_RESOLVER      DNS server nginx re-resolves ROUTER_UPSTREAM with (default: the first nameserver of
#                    /etc/resolv.conf, Docker's 127.0.0.11 on a user-defined network)
set -eu
: "${ROUTER_UPSTREAM:?set ROUTER_UPSTREAM to host:port of the routers DNS name}"
LB_PORT=${LB_PORT:-8080}
LB_RESOLVER=${LB_RESOLVER:-$(awk '/^nameserver/ {print $2; exit}' /etc/resolv.conf)}
case "$LB_RESOLVER" in *:*:*) LB_RESOLVER="[$LB_RESOLVER]" ;; esac   # an IPv6 resolver needs brackets
conf=/etc/nginx/conf.d/talaria.conf
mkdir -p /etc/nginx/conf.d
sed -e "s|\${ROUTER_UPSTREAM}|$ROUTER_UPSTREAM|g" -e "s|\${LB_PORT}|$LB_PORT|g" -e "s|\${LB_RESOLVER}|$LB_RESOLVER|g" \
  /etc/talaria/nginx.conf.template > "$conf"
rm -f /etc/nginx/conf.d/default.conf
exec nginx -g 'daemon off;'
