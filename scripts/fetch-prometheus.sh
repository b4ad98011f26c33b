#!/usr/bin/env bash
# Puts Prometheus and promtool (Debian 12's build, 2.42) into DIR, for the monitoring tests:
# promtool checks and unit-tests deploy/monitoring's rules, and the end-to-end suite runs a real
# Prometheus against a real Envoy and sidecar-metrics. No root needed: the package is only
# unpacked (dpkg-deb -x), not installed.
#
#   scripts/fetch-prometheus.sh DIR
#
# The pinned package is checked against its SHA-256. Should Debian's mirror have moved on from
# it, `apt-get download prometheus` takes the current one instead.
set -euo pipefail

out=${1:?usage: $0 DIR}
version=2.42.0+ds-5+b6
url="https://deb.debian.org/debian/pool/main/p/prometheus/prometheus_${version//+/%2B}_amd64.deb"
sha256=3b0e0255b059a7696bd4a139a4a4eb24d71df067936a61ece5093559cbc7991c

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
deb="$work/prometheus.deb"

if curl -fsSL --retry 3 -o "$deb" "$url" && echo "$sha256  $deb" | sha256sum -c --quiet -; then
    :
else
    echo "fetch-prometheus: $url unavailable or changed; trying apt-get download prometheus" >&2
    rm -f "$deb"
    (cd "$work" && apt-get download prometheus >/dev/null)
    deb=$(ls "$work"/prometheus_*.deb)
fi

dpkg-deb -x "$deb" "$work/x"
mkdir -p "$out"
install -m 0755 "$work/x/usr/bin/prometheus" "$work/x/usr/bin/promtool" "$out/"
"$out/promtool" --version 2>&1 | head -1
