#!/bin/sh
# The upstream nginx image's entrypoint, as far as lorafleet uses it: source every executable
# /docker-entrypoint.d/*.envsh and run every executable *.sh there, in order; 20-envsubst-on-templates.sh
# renders /etc/nginx/templates/X.template to /etc/nginx/conf.d/X.
set -eu
for script in $(find /docker-entrypoint.d/ -follow -type f -print | sort -V); do
    [ -x "$script" ] || continue
    case "$script" in
        *.envsh) . "$script" ;;
        *.sh) "$script" ;;
    esac
done
exec "$@"
