"""The access log line of render.py's `access_log` option, in a real Envoy with the filter: each
request's line says which pool and pods the filter chose and which pod served it."""

import json
import time

import pytest

from harness import Envoy, snapshot
from stubpod import serving

CONFIG = {
    "pools": [
        {"name": "llama", "models": ["llama-3-8b"], "adapters": ["sql-lora"]},
        {"name": "qwen", "models": ["qwen-7b"]},
    ],
}


@pytest.fixture(scope="module")
def pods():
    with serving(["llama-0", "llama-1", "qwen-0"]) as pods:
        yield pods


@pytest.fixture(scope="module")
def gateway(pods, tmp_path_factory):
    log = tmp_path_factory.mktemp("access") / "access.log"
    pools = [
        {"name": "llama", "endpoints": [pods["llama-0"].address, pods["llama-1"].address]},
        {"name": "qwen", "endpoints": [pods["qwen-0"].address]},
    ]
    # Envoy writes access log files every 10 s by default; the test reads them sooner.
    e = Envoy("filter", pools, CONFIG, extra={"access_log": str(log)}, envoy_args=("--file-flush-interval-msec", "100"))
    yield e, log
    e.stop()


def fresh(pods, **llama):
    return snapshot(
        {
            "llama": [dict({"address": pods[f"llama-{i}"].address}, **llama) for i in range(2)],
            "qwen": [{"address": pods["qwen-0"].address}],
        }
    )


def line_of(log, request_id, timeout=5.0):
    """The access log line of one request (Envoy writes the file from a flush thread)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for raw in log.read_text().splitlines():
            entry = json.loads(raw)
            if entry["request_id"] == request_id:
                return entry
        time.sleep(0.05)
    raise AssertionError(f"no access log line for {request_id}: {log.read_text()[-2000:]}")


def logged(gateway, model, request_id, **headers):
    """A chat request with this request id: its status, response headers and access log line."""
    e, log = gateway
    s, h, _, _ = e.chat(model, headers={"x-request-id": request_id, **headers})
    return s, h, line_of(log, request_id)


def test_a_picked_request_logs_its_pool_its_pods_and_who_served(gateway, pods):
    assert gateway[0].push(fresh(pods))[0] == 204
    s, h, entry = logged(gateway, "llama-3-8b", "req-picked")
    assert s == 200
    served = pods[h["x-served-by"]].address
    assert entry["status"] == 200 and entry["pool"] == "llama" and entry["model"] == "llama-3-8b"
    destination = entry["destination"].split(",")
    assert destination[0] == served == entry["upstream_host"], entry
    assert set(destination) == {pods["llama-0"].address, pods["llama-1"].address}, entry
    assert entry["path"] == "/v1/chat/completions" and entry["method"] == "POST"


def test_an_adapter_request_logs_its_base_model(gateway, pods):
    assert gateway[0].push(fresh(pods))[0] == 204
    s, _, entry = logged(gateway, "sql-lora", "req-adapter")
    assert s == 200
    assert (entry["model"], entry["base_model"], entry["pool"]) == ("sql-lora", "llama-3-8b", "llama"), entry


def test_a_fail_open_logs_no_destination_and_envoys_pick(gateway, pods):
    assert gateway[0].push(fresh(pods, healthy=False))[0] == 204
    s, h, entry = logged(gateway, "llama-3-8b", "req-fail-open")
    assert s == 200
    assert entry["pool"] == "llama" and entry["destination"] is None, entry
    assert entry["upstream_host"] == pods[h["x-served-by"]].address


def test_requests_the_filter_answers_log_their_status_and_no_pool(gateway, pods):
    s, _, entry = logged(gateway, "no-such-model", "req-404")
    assert s == 404
    assert entry["status"] == 404 and entry["pool"] is None and entry["upstream_host"] is None, entry


def test_a_forged_routing_header_is_not_what_the_log_shows(gateway, pods):
    assert gateway[0].push(fresh(pods))[0] == 204
    s, h, entry = logged(gateway, "qwen-7b", "req-forged", **{"x-gateway-destination-endpoint": "10.9.9.9:80",
                                                              "x-gateway-pool": "llama"})
    assert s == 200 and h["x-served-by"] == "qwen-0"
    assert entry["pool"] == "qwen" and entry["destination"] == pods["qwen-0"].address, entry
