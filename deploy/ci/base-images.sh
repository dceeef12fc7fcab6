#!/usr/bin/env bash
# CI only: build local look-alikes of the upstream base images the project's Dockerfiles and compose
# file name (python:3.11-slim, redis:7.4-alpine, nginx:1.27-alpine, prom/prometheus:v2.55.1,
# nvidia/cuda:13.0.0-base-ubuntu24.04), because the CI machines reach package registries but no image
# registry. Each is Debian bookworm (debootstrap minbase from the machine's apt mirror) plus Debian's
# package of the same program; they are tagged with the upstream names so that the Dockerfiles build
# unchanged with --pull=never. Users pull the real images; nothing here is needed with a registry.
#
# The Debian base is made once per machine (~30 s); the look-alikes rebuild only when their files change
# (podman's layer cache).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
base=localhost/lorafleet-ci/debian:bookworm
mirror="$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)"
mirror="${mirror:-http://deb.debian.org/debian}"

if ! podman image exists "$base"; then
    rootfs="$(mktemp -d /var/tmp/lorafleet-ci-rootfs.XXXXXX)"
    trap 'rm -rf "$rootfs"' EXIT
    echo "base-images: debootstrap bookworm from $mirror"
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/dev/null
    # this machine's CA certificates (its egress may re-sign TLS), kept when an image reinstalls
    # ca-certificates, and pip told to use them (pip's own bundle would not have them)
    mkdir -p "$rootfs/usr/local/share/ca-certificates"
    find /usr/local/share/ca-certificates -maxdepth 1 -name '*.crt' -exec cp {} "$rootfs/usr/local/share/ca-certificates/" \;
    install -D -m 0644 /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$rootfs/etc/pip.conf"
    printf 'APT::Install-Recommends "false";\n' > "$rootfs/etc/apt/apt.conf.d/99no-recommends"
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
    tar -C "$rootfs" -c . | podman import --change 'CMD ["bash"]' - "$base" >/dev/null
    echo "base-images: imported $base"
fi

build() {  # build IMAGE_NAME CONTAINERFILE
    podman build --quiet --pull=never -t "$1" -f "$here/lookalikes/$2" "$here/lookalikes" >/dev/null
    echo "base-images: $1 (look-alike)"
}
build docker.io/library/python:3.11-slim python.Containerfile
build docker.io/library/redis:7.4-alpine redis.Containerfile
build docker.io/library/nginx:1.27-alpine nginx.Containerfile
build docker.io/prom/prometheus:v2.55.1 prometheus.Containerfile
build docker.io/nvidia/cuda:13.0.0-base-ubuntu24.04 cuda.Containerfile
