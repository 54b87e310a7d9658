#!/usr/bin/env bash
# A simulated multi-node cluster on this machine: network namespaces on a bridge, shaped links, Ray.
# A thin wrapper over `python -m pdserve.cluster.simnet` (docs/simulated-cluster.md); needs root.
#
#   scripts/simcluster.sh up [--node NAME[:CPUS[:PROFILE]]]... [--profile fast|slow|thin|wan] [--no-ray]
#   scripts/simcluster.sh status [PREFIX...] [--json]
#   scripts/simcluster.sh exec PREFIX NODE -- COMMAND...     # inside NODE, with RAY_ADDRESS and the token
#   scripts/simcluster.sh profile PREFIX NODE fast|slow|thin|wan
#   scripts/simcluster.sh partition|heal PREFIX NODE
#   scripts/simcluster.sh down PREFIX... | --stale | --all   # by prefix: also what a crashed run left
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$here/.venv/bin/python" ]]; then python="$here/.venv/bin/python"; else python=python3; fi
fi
# `exec` runs its command with this PATH: `python` and `ray` there are the environment's own.
if [[ "$python" == */* ]]; then export PATH="$(dirname "$python"):$PATH"; fi
exec "$python" -m pdserve.cluster.simnet "$@"
