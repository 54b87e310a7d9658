#!/usr/bin/env bash
# The head node's setup for pdserve: `ray up` runs it on the head only (head_setup_commands in
# cluster-gpu.yaml). Safe to run again. `ray up --restart-only` skips it, and needs nothing from
# it that a restart could change: the Redis URL the workers use is made at every start of the
# service (run-pdserve.sh).
#
#   bash setup-head.sh [DIR]      (default: ~/pdserve, where cluster-gpu.yaml's file_mounts land)
#
# 1. Redis (apt redis-server; pdserve needs streams, Redis >= 5) with the settings redis-conf.sh
#    (next to this script) prints: port 6379 on 127.0.0.1 and the node's private IP (the one
#    run-pdserve.sh gives the workers), the password from DIR/secrets.env, no persistence (Redis is
#    pdserve's block index, not its source of truth: the workers republish the index when Redis
#    comes back empty).
# 2. The systemd unit pdserve.service (DIR/pdserve.service), enabled; head_start_ray_commands
#    (re)starts it after Ray.
set -euo pipefail

DIR="${1:-$HOME/pdserve}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONF_D=/etc/redis/pdserve.conf
MAIN_CONF=/etc/redis/redis.conf

say() { echo "setup-head: $*" >&2; }

[[ -f "$DIR/secrets.env" ]] || { say "no $DIR/secrets.env: run deploy/make-secrets.sh, then ray up again"; exit 1; }
chmod 600 "$DIR/secrets.env"
tmp="$(mktemp)"  # mode 0600: it holds the password
trap 'rm -f "$tmp"' EXIT
# Before anything is installed: it checks the password and finds the private IP, or stops here.
bash "$HERE/redis-conf.sh" "$DIR" >"$tmp"
password="$(sed -n 's/^requirepass //p' "$tmp")"
ip="$(sed -n 's/^bind 127\.0\.0\.1 //p' "$tmp")"

if ! command -v redis-server >/dev/null; then
    say "installing redis-server"
    sudo apt-get -o DPkg::Lock::Timeout=600 update -y
    sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y redis-server redis-tools
fi
version="$(redis-server --version | sed -n 's/.* v=\([0-9]*\)\..*/\1/p')"
if [[ -z "$version" || "$version" -lt 5 ]]; then
    say "redis-server $(redis-server --version) has no streams (pdserve needs Redis >= 5): use an image with" \
        "Ubuntu 22.04 or newer (see cluster-gpu.yaml)"
    exit 1
fi

sudo install -m 640 -o redis -g redis "$tmp" "$CONF_D"
grep -qxF "include ${CONF_D}" "$MAIN_CONF" || echo "include ${CONF_D}" | sudo tee -a "$MAIN_CONF" >/dev/null
sudo systemctl enable redis-server >/dev/null 2>&1 || true
sudo systemctl restart redis-server
for _ in $(seq 1 50); do
    if REDISCLI_AUTH="$password" redis-cli -p 6379 ping 2>/dev/null | grep -q PONG; then
        say "redis-server $version answers on ${ip}:6379"
        break
    fi
    sleep 0.2
done

sed -e "s|@USER@|$USER|g" -e "s|@HOME@|$HOME|g" "$DIR/pdserve.service" >"$tmp"
sudo install -m 644 "$tmp" /etc/systemd/system/pdserve.service
sudo systemctl daemon-reload
sudo systemctl enable pdserve >/dev/null
say "pdserve.service installed; it starts after Ray (head_start_ray_commands)"
