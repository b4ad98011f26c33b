#!/usr/bin/env bash
# Builds the filter's .wasm as it was at a commit of this repository's history (the build the
# upgrade tests run beside this one): the commit's sources from `git archive`, its own
# Cargo.lock, the same profile. Output: OUT_DIR/COMMIT/gpuroute_filter.wasm.
#   scripts/build-base-wasm.sh COMMIT OUT_DIR
set -euo pipefail
commit=$1
out=$2
root=$(cd "$(dirname "$0")/.." && pwd)
have() { git -C "$root" cat-file -e "$commit^{commit}" 2>/dev/null; }
if ! have && [ "$(git -C "$root" rev-parse --is-shallow-repository)" = true ]; then
    git -C "$root" fetch --quiet --unshallow || true
fi
if ! have; then
    echo "build-base-wasm: commit $commit is not in this clone's history (a shallow clone?);" \
         "'git fetch --unshallow' fetches it" >&2
    exit 1
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git -C "$root" archive "$commit" | tar -x -C "$src"
# One target directory for every base commit: their dependencies are mostly the same.
(cd "$src" && cargo build --locked -q -p gpuroute-filter --target wasm32-wasip1 --profile wasm-release \
    --target-dir "$out/target")
mkdir -p "$out/$commit"
cp "$out/target/wasm32-wasip1/wasm-release/gpuroute_filter.wasm" "$out/$commit/gpuroute_filter.wasm"
echo "base filter ($commit): $out/$commit/gpuroute_filter.wasm ($(stat -c %s "$out/$commit/gpuroute_filter.wasm") bytes)"
