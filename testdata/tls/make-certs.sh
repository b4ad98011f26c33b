#!/usr/bin/env bash
# Test-only certificates for the HTTPS pod tests (sidecar-metrics' scrape tests and the
# end-to-end suite's TLS pods). Valid for 100 years; never use them for anything else.
# Regenerate with: testdata/tls/make-certs.sh (needs openssl).
set -euo pipefail
cd "$(dirname "$0")"
days=36500
key() { openssl ecparam -name prime256v1 -genkey -noout | openssl pkcs8 -topk8 -nocrypt -out "$1"; }
ca() {  # name, subject
    key "$1.key"
    openssl req -x509 -new -key "$1.key" -subj "/CN=$2" -days $days -sha256 \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" -out "$1.pem"
}
leaf() {  # name, subject, extensions
    key "$1.key"
    openssl req -new -key "$1.key" -subj "/CN=$2" -out "$1.csr"
    printf '%b' "$3" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days $days -sha256 \
        -extfile "$1.ext" -out "$1.pem" 2>/dev/null
    rm -f "$1.csr" "$1.ext"
}
ca ca "gpuroute test CA"
ca other-ca "another test CA"
rm -f other-ca.key
leaf pod "pod.test" "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:pod.test\n"
leaf pod-by-name "pod.test" "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\nsubjectAltName=DNS:pod.test\n"
leaf client "sidecar-metrics" "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n"
leaf peer "gpuroute-peers" "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:gpuroute-peers\n"
rm -f ca.key ca.srl
