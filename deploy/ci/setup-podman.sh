#!/usr/bin/env bash
# Install what `make deploy-test` needs on a CI machine (Debian, as root): podman with runc and
# netavark/aardvark-dns from Debian, iptables (netavark sets up container networks with it but does
# not depend on it: without it every RUN step fails with "netavark: No such file or directory"),
# debootstrap for the local base images, and this directory's containers.conf. podman-compose and
# kubernetes-validate come from PyPI into the project's venv (the Makefile's `deploy` extra). Safe to run again: it installs only what is missing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

packages=(podman runc netavark aardvark-dns iptables debootstrap)
missing=()
for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
    echo "setup-podman: installing ${missing[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

install -D -m 0644 "$here/containers.conf" /etc/containers/containers.conf
# no registry is reachable: unqualified names resolve to the local images only
printf 'unqualified-search-registries = []\nshort-name-mode = "disabled"\n' \
    > /etc/containers/registries.conf.d/50-lorafleet-ci.conf
podman info --format '{{.Host.OCIRuntime.Name}} {{.Host.CgroupManager}} {{.Store.GraphDriverName}}'
