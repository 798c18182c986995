#!/bin/sh
# Writes the cluster's secrets into deploy/compose/.env (mode 600) the first time; an existing value is kept,
# so running it again changes nothing. docker compose reads .env beside the compose file.
#   NATS_PASSWORD / NATS_OBSERVER_PASSWORD   NATS users talaria and observer (nats/auth.example.conf)
#   KVSTORE_TOKEN                           bearer token engines present to the kvstores
#   RESUME_SECRET                           HMAC key of resume tokens, shared by the routers
#   TALARIA_API_KEY                         the API key of tenant "default" (clients send it as a Bearer token)
set -eu
env_file=${1:-$(dirname "$0")/.env}
umask 077
touch "$env_file"
for name in NATS_PASSWORD NATS_OBSERVER_PASSWORD KVSTORE_TOKEN RESUME_SECRET TALARIA_API_KEY; do
  if ! grep -q "^$name=." "$env_file"; then
    sed -i "/^$name=\$/d" "$env_file"   # an empty line from .env.example
    echo "$name=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')" >> "$env_file"
    echo "gen-secrets: $name generated in $env_file"
  fi
done
