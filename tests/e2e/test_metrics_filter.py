"""sidecar-metrics asks a pod for only the metrics it reads (`filter_metrics`, `?name[]=...`),
against the real prometheus_client, the library vLLM and SGLang serve /metrics with: the same
reading from a body a twentieth the size, and a whole scrape where the registry cannot restrict
(a multiprocess registry, SGLang's always and vLLM's with PROMETHEUS_MULTIPROC_DIR, collects
without names). No Envoy here: run in the proxy-wasm pass
only."""

import sys
from pathlib import Path

import pytest
from harness import RUNTIME, SIDECAR

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import metrics_filter_cost as m  # noqa: E402

pytestmark = pytest.mark.skipif(RUNTIME != "wasm", reason="no Envoy involved: runs in the proxy-wasm pass")


@pytest.fixture
def served():
    servers = []

    def serve(reg):
        server = m.serve(reg)
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/metrics"

    yield serve
    for s in servers:
        s.shutdown()


def test_a_vllm_registry_answers_only_what_is_read_and_it_reads_the_same(served):
    reg, made, _ = m.registry_like_vllm(m.SAMPLE.read_text())
    assert made > 30
    url = served(reg)
    filtered, whole = m.scrape_once(SIDECAR, url, False), m.scrape_once(SIDECAR, url, True)
    assert filtered["filtered"] and not whole["filtered"]
    assert m.same_reading(filtered, whole)
    # waiting, running, KV use, cache geometry, inter-token latency: all there.
    assert len(filtered["raw"]) >= 8
    assert filtered["pod"]["block_size"] == 16
    assert filtered["body_bytes"][0] * 10 < whole["body_bytes"][0], (filtered["body_bytes"], whole["body_bytes"])
    # Configured as vLLM, the pod is asked for vLLM's names only: the same reading again.
    as_vllm = m.scrape_once(SIDECAR, url, False, engine="vllm")
    assert as_vllm["filtered"] and not as_vllm["engine_detected"]
    assert m.same_reading(as_vllm, whole)
    assert as_vllm["body_bytes"][0] <= filtered["body_bytes"][0]


def test_a_registry_that_cannot_restrict_is_read_whole(served):
    # vLLM with PROMETHEUS_MULTIPROC_DIR serves a registry whose collector has no names: asked
    # for some, prometheus_client answers none of them.
    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    text = m.SAMPLE.read_text()

    class Nameless:
        def collect(self):
            return list(text_string_to_metric_families(text))

    reg = CollectorRegistry()
    reg.register(Nameless())
    url = served(reg)
    got, whole = m.scrape_once(SIDECAR, url, False), m.scrape_once(SIDECAR, url, True)
    assert not got["filtered"]
    assert got["body_bytes"] == whole["body_bytes"]
    assert m.same_reading(got, whole)
