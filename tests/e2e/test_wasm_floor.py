"""The proxy-wasm floor (bench/wasm-floor), the reference `make bench-envoy` measures beside the
filter, in a real Envoy: it must do the job it stands for (pause, read the body, route by the
pool header, send each request to the endpoint it names, drop a client's forged destination),
or the floor it reports would be a floor of something else."""

import pytest

from harness import FLOOR_WASM, RUNTIME, Envoy

# The floor built with its `callbacks` feature: the same job, plus the filter's three other
# callbacks exported empty (`scripts/envoy_overhead.py --floor-callbacks`).
FLOOR_CALLBACKS_WASM = FLOOR_WASM.parents[2] / "wasm-floor-callbacks" / "wasm32-wasip1" / "wasm-release" / FLOOR_WASM.name
from stubpod import StubPod

pytestmark = pytest.mark.skipif(RUNTIME != "wasm", reason="a proxy-wasm reference: runs once, in the wasm suite")


@pytest.fixture(scope="module", params=[FLOOR_WASM, FLOOR_CALLBACKS_WASM], ids=["floor", "floor_callbacks"])
def floor(request):
    pods = [StubPod(f"llama-{i}") for i in range(3)]
    addrs = [p.address for p in pods]
    config = {"pools": [{"name": "llama", "models": ["llama-3-8b"]}], "floor_endpoints": addrs}
    e = Envoy("filter", [{"name": "llama", "endpoints": addrs}], config, runtime="wasm", wasm=request.param)
    yield e
    e.stop()
    for p in pods:
        p.close()


def test_floor_sends_each_request_where_its_destination_header_says(floor):
    served = []
    for _ in range(6):
        status, headers, body, _ = floor.chat("llama-3-8b", text="x" * 4000)
        assert status == 200
        served.append(headers["x-served-by"])
        # What the pod received: the headers the floor set from the body and its configuration.
        assert body["headers"]["x-gateway-pool"] == "llama"
        assert body["headers"]["x-gateway-model-name"] == "llama-3-8b"
    # Round robin over the configured endpoints, in their order (Envoy's own fallback policy,
    # least_request, would not give this sequence).
    start = int(served[0].rsplit("-", 1)[1])
    assert served == [f"llama-{(start + i) % 3}" for i in range(6)]


def test_floor_drops_a_forged_destination(floor):
    status, headers, body, _ = floor.chat("llama-3-8b")
    nxt = (int(headers["x-served-by"].rsplit("-", 1)[1]) + 1) % 3
    forged = floor.chat("llama-3-8b", headers={"x-gateway-destination-endpoint": "127.0.0.1:1"})
    assert forged[0] == 200
    assert forged[1]["x-served-by"] == f"llama-{nxt}"
    assert forged[2]["headers"]["x-gateway-destination-endpoint"] != "127.0.0.1:1"


def test_the_callbacks_build_exports_the_filters_three_other_callbacks():
    """What Envoy calls is what the module exports: the callbacks build must export exactly the
    three the filter adds to the floor's, or it would measure something else."""
    import json
    import subprocess

    script = ("const fs=require('fs');const out={};for(const p of process.argv.slice(1)){"
              "out[p]=WebAssembly.Module.exports(new WebAssembly.Module(fs.readFileSync(p))).map(e=>e.name)}"
              "console.log(JSON.stringify(out))")
    out = json.loads(subprocess.run(["node", "-e", script, str(FLOOR_WASM), str(FLOOR_CALLBACKS_WASM)],
                                    check=True, capture_output=True, text=True).stdout)
    callbacks = {n for n in out[str(FLOOR_CALLBACKS_WASM)] if n.startswith("proxy_on")}
    plain = {n for n in out[str(FLOOR_WASM)] if n.startswith("proxy_on")}
    assert callbacks - plain == {"proxy_on_response_headers", "proxy_on_response_body", "proxy_on_delete"}
    assert plain <= callbacks
