"""The host that `make profile-wasm` and `make profile-wasm-instr` run the built filter in
(scripts/wasm_profile.mjs: a few lines of JavaScript under Node's V8, standing in for Envoy). It
must give every host function the filter imports and see every request picked, or those tools
profile nothing: they broke that way once, for a day, when `hold` added two imports."""

import subprocess
import sys

import pytest

from harness import ROOT, RUNTIME, WASM

sys.path.insert(0, str(ROOT / "scripts"))
import envoy_overhead  # noqa: E402  (the 4 KB chat body the Envoy benchmarks send)

pytestmark = pytest.mark.skipif(RUNTIME != "wasm", reason="the proxy-wasm build's tool: runs once, in the wasm suite")


def test_the_profiling_host_links_the_built_filter_and_every_request_is_picked(tmp_path):
    body = tmp_path / "chat.json"
    body.write_bytes(envoy_overhead.chat_body())
    run = subprocess.run(["node", "--no-warnings", str(ROOT / "scripts" / "wasm_profile.mjs"), str(WASM), str(body), "50"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "gpuroute.pool.llama.requests.picked 50" in run.stdout, run.stdout
