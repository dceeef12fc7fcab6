#!/bin/sh
# The upstream nginx image's 20-envsubst-on-templates.sh, as far as lorafleet uses it: only variables
# set in the environment are replaced, so nginx's own ($host, ...) stay.
set -eu
defined=$(env | sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\)=.*/${\1}/p' | tr '\n' ' ')
for template in /etc/nginx/templates/*.template; do
    [ -f "$template" ] || continue
    envsubst "$defined" < "$template" > "/etc/nginx/conf.d/$(basename "$template" .template)"
done
