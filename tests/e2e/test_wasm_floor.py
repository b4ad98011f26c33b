"""The proxy-wasm floor (bench/wasm-floor), the reference `make bench-envoy` measures beside the
filter, in a real Envoy: it must do the job it stands for (pause, read the body, route by the
pool header, send each request to the endpoint it names, drop a client's forged destination),
or the floor it reports would be a floor of something else."""

import pytest

from harness import FLOOR_WASM, RUNTIME, Envoy
from stubpod import StubPod

pytestmark = pytest.mark.skipif(RUNTIME != "wasm", reason="a proxy-wasm reference: runs once, in the wasm suite")


@pytest.fixture(scope="module")
def floor():
    pods = [StubPod(f"llama-{i}") for i in range(3)]
    addrs = [p.address for p in pods]
    config = {"pools": [{"name": "llama", "models": ["llama-3-8b"]}], "floor_endpoints": addrs}
    e = Envoy("filter", [{"name": "llama", "endpoints": addrs}], config, runtime="wasm", wasm=FLOOR_WASM)
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
