#!/usr/bin/env bash
# What pdserve.service runs on the head node (systemd restarts it when it fails). Everything that
# depends on the node is worked out here, at every start, so `ray up --restart-only` and a changed
# service.json need no setup step: the private IP (for the Redis URL the workers use), the
# secrets from ~/pdserve/secrets.env (systemd's EnvironmentFile).
set -euo pipefail

: "${PDSERVE_REDIS_PASSWORD:?missing: run deploy/make-secrets.sh before ray up}"
: "${PDSERVE_CLUSTER_SECRET:?missing: run deploy/make-secrets.sh before ray up}"
: "${PDSERVE_HASH_SEED:?missing: run deploy/make-secrets.sh before ray up}"

# This node's private IP, found as redis-conf.sh finds it (the address Redis is bound to): the
# source address of the default route; without a default route, the first address `hostname -I`
# lists.
ip="$({ ip -4 route get 1.1.1.1 2>/dev/null || true; } | sed -n 's/.* src \([0-9.]*\).*/\1/p' | head -n 1)"
[[ -n "$ip" ]] || ip="$({ hostname -I 2>/dev/null || true; } | awk '{print $1}')"
[[ -n "$ip" ]] || { echo "run-pdserve: cannot tell this node's private IP" >&2; exit 1; }
# In the environment, not on the command line: ps shows arguments to every user.
export PDSERVE_REDIS_URL="redis://:${PDSERVE_REDIS_PASSWORD}@${ip}:6379/0"

exec "$HOME/pdserve-venv/bin/pdserve" up --config "$HOME/pdserve/service.json" --ray-address auto \
    --log-level INFO
