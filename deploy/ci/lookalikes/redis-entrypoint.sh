#!/bin/sh
# What the upstream redis image's entrypoint does that lorafleet relies on: a redis-server started
# without a config file listens to the other containers (protected mode off; the network is private).
set -eu
if [ "$1" = "redis-server" ] && ! [ -f "${2:-}" ]; then
    set -- "$@" --protected-mode no
fi
exec "$@"
