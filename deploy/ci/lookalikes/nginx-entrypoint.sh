#!/bin/sh
# What the upstream nginx image's entrypoint does that lorafleet relies on (15-local-resolvers.envsh and
# 20-envsubst-on-templates.sh): NGINX_LOCAL_RESOLVERS from /etc/resolv.conf, then every
# /etc/nginx/templates/X.template rendered to /etc/nginx/conf.d/X with only the set variables replaced.
set -eu
if [ -n "${NGINX_ENTRYPOINT_LOCAL_RESOLVERS:-}" ]; then
    NGINX_LOCAL_RESOLVERS=$(awk 'BEGIN{ORS=" "} $1=="nameserver" {if ($2 ~ ":") print "[" $2 "]"; else print $2}' /etc/resolv.conf)
    export NGINX_LOCAL_RESOLVERS="${NGINX_LOCAL_RESOLVERS% }"
fi
defined=$(env | sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\)=.*/${\1}/p' | tr '\n' ' ')
for template in /etc/nginx/templates/*.template; do
    [ -f "$template" ] || continue
    name=$(basename "$template" .template)
    envsubst "$defined" < "$template" > "/etc/nginx/conf.d/$name"
done
exec "$@"
