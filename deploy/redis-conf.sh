#!/usr/bin/env bash
# Prints the head node's Redis settings for pdserve: the part of setup-head.sh that needs no root,
# no apt and no systemd (setup-head.sh installs its output as /etc/redis/pdserve.conf).
#
#   bash redis-conf.sh [DIR] > pdserve.conf      (default DIR: ~/pdserve; holds secrets.env)
#
# Reads PDSERVE_REDIS_PASSWORD from DIR/secrets.env and refuses one that is not 16 or more of
# [A-Za-z0-9._~-] (it goes into redis:// URLs unescaped). Works out this node's private IP as
# run-pdserve.sh does (keep the two the same: the workers get that address in the Redis URL).
# Prints: port 6379, bound to 127.0.0.1 and that IP, protected mode, the password, no persistence
# (Redis is pdserve's block index, not its source of truth: the workers republish the index when
# Redis comes back empty). The output holds the password: write it where only its owner reads it.
# Exits non-zero, saying why on stderr and printing nothing, when any step fails.
set -euo pipefail

DIR="${1:-$HOME/pdserve}"

say() { echo "redis-conf: $*" >&2; }

[[ -f "$DIR/secrets.env" ]] || { say "no $DIR/secrets.env: run deploy/make-secrets.sh, then ray up again"; exit 1; }
password="$(sed -n 's/^PDSERVE_REDIS_PASSWORD=//p' "$DIR/secrets.env")"
if [[ ! "$password" =~ ^[A-Za-z0-9._~-]{16,}$ ]]; then
    say "PDSERVE_REDIS_PASSWORD in $DIR/secrets.env must be 16+ of [A-Za-z0-9._~-] (make-secrets.sh writes hex)"
    exit 1
fi

# The private IP: the source address of the default route (stable across restarts of the node);
# without a default route, the first address `hostname -I` lists.
ip="$({ ip -4 route get 1.1.1.1 2>/dev/null || true; } | sed -n 's/.* src \([0-9.]*\).*/\1/p' | head -n 1)"
[[ -n "$ip" ]] || ip="$({ hostname -I 2>/dev/null || true; } | awk '{print $1}')"
[[ -n "$ip" ]] || { say "cannot tell this node's private IP"; exit 1; }

cat <<EOT
# pdserve's Redis settings, written by deploy/redis-conf.sh (setup-head.sh includes this file last
# in /etc/redis/redis.conf, so it wins).
port 6379
bind 127.0.0.1 ${ip}
protected-mode yes
requirepass ${password}
save ""
appendonly no
EOT
