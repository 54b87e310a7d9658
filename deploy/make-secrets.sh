#!/usr/bin/env bash
# Writes deploy/secrets.env once, on the machine that runs `ray up` (never overwrites it):
#
#   PDSERVE_HASH_SEED       the cluster's block-hash seed (docs/block-hashes.md)
#   PDSERVE_CLUSTER_SECRET  authenticates the KV-transfer plane between workers
#   PDSERVE_REDIS_PASSWORD  the head node's Redis
#
# cluster-gpu.yaml copies it to the head node (~/pdserve/secrets.env, mode 0600), so the service
# keeps one set across restarts, `ray up --restart-only` and nodes added later. Keep it out
# of version control (.gitignore lists it); `ray down` does not delete it.
set -euo pipefail

out="${1:-$(dirname "$0")/secrets.env}"
if [[ -e "$out" ]]; then
    echo "make-secrets: $out exists; keeping it (delete it first to rotate every secret)" >&2
    exit 0
fi
hex() { python3 -c 'import secrets, sys; print(secrets.token_hex(int(sys.argv[1])))' "$1"; }
umask 077
cat >"$out" <<EOT
# pdserve cluster secrets, written by deploy/make-secrets.sh. Keep private.
PDSERVE_HASH_SEED=$(hex 32)
PDSERVE_CLUSTER_SECRET=$(hex 32)
PDSERVE_REDIS_PASSWORD=$(hex 24)
EOT
echo "make-secrets: wrote $out (mode 0600)" >&2
