"""The gateway's own answers, read by the official client SDKs (pinned in the Makefile): each
error the filter answers itself raises the SDK exception a model server's error of that kind
would, with the fields the SDK exposes (OpenAI's `code` and `param`, Anthropic's error type).
Clients written against those SDKs then handle a gateway error as they handle a server's."""

import anthropic
import openai
import pytest

from harness import Envoy, snapshot
from stubpod import StubPod

# A model name with a slash, as Hugging Face names are: the SDKs put it in a path.
HF = "meta-llama/Llama-3.1-8B-Instruct"
CONFIG = {"pools": [{"name": "llama", "models": ["llama-3-8b", HF], "aliases": {"llama": "llama-3-8b"}}]}
HI = [{"role": "user", "content": "hi"}]
# Over the filter's default max_body_bytes (4 MiB).
HUGE = [{"role": "user", "content": "x" * (4 * 1024 * 1024 + 10)}]


@pytest.fixture(scope="module")
def gateway():
    pods = [StubPod(f"llama-{i}") for i in range(2)]
    e = Envoy("filter", [{"name": "llama", "endpoints": [p.address for p in pods]}], CONFIG)
    e.pods = pods
    yield e
    e.stop()
    for p in pods:
        p.close()


def saturate(e):
    """A fresh snapshot with every pod saturated: a sheddable request is then refused (429)."""
    busy = {"waiting": 50, "running": 60, "kv_cache_usage": 0.99}
    assert e.push(snapshot({"llama": [dict(busy, address=p.address) for p in e.pods]}))[0] == 204


def base_url(e):
    return f"http://{e.listen}"


def test_openai_sdk_raises_the_matching_errors(gateway):
    c = openai.OpenAI(base_url=base_url(gateway) + "/v1", api_key="x", max_retries=0)
    chat = c.chat.completions.create

    with pytest.raises(openai.NotFoundError) as info:
        chat(model="gpt-9", messages=HI)
    e = info.value
    assert (e.code, e.param) == ("model_not_found", "model")

    with pytest.raises(openai.BadRequestError) as info:
        chat(model=7, messages=HI)
    e = info.value
    assert (e.code, e.param) == ("invalid_type", "model")

    with pytest.raises(openai.BadRequestError) as info:
        chat(model=None, messages=HI)
    e = info.value
    assert e.code == "missing_required_parameter"

    with pytest.raises(openai.APIStatusError) as info:
        chat(model="llama-3-8b", messages=HUGE)
    e = info.value
    assert e.status_code == 413, repr(e)
    assert e.code == "request_too_large"

    saturate(gateway)
    with pytest.raises(openai.RateLimitError) as info:
        chat(model="llama-3-8b", messages=HI, extra_headers={"x-gateway-priority": "-1"})
    e = info.value
    assert e.code == "pool_saturated"

    with pytest.raises(openai.NotFoundError) as info:
        c.embeddings.create(model="gpt-9", input="hi")
    e = info.value
    assert e.code == "model_not_found", repr(e)

    # The model list the gateway answers itself parses as the SDK's models, and so does one.
    ids = {m.id for m in c.models.list()}
    assert ids == {"llama-3-8b", HF, "llama"}, ids
    m = c.models.retrieve(HF)
    assert (m.id, m.object, m.owned_by) == (HF, "model", "gpuroute")
    assert c.models.retrieve("llama").id == "llama"
    with pytest.raises(openai.NotFoundError) as info:
        c.models.retrieve("gpt-9")
    assert info.value.code == "model_not_found", repr(info.value)


def test_anthropic_sdk_raises_the_matching_errors(gateway):
    c = anthropic.Anthropic(base_url=base_url(gateway), api_key="x", max_retries=0)
    create = c.messages.create

    def kind(e):
        return e.body["error"]["type"]

    with pytest.raises(anthropic.NotFoundError) as info:
        create(model="claude-9", max_tokens=8, messages=HI)
    e = info.value
    assert kind(e) == "not_found_error", repr(e)

    with pytest.raises(anthropic.NotFoundError) as info:
        c.messages.count_tokens(model="claude-9", messages=HI)
    e = info.value
    assert kind(e) == "not_found_error", repr(e)

    with pytest.raises(anthropic.BadRequestError) as info:
        create(model=7, max_tokens=8, messages=HI)
    e = info.value
    assert kind(e) == "invalid_request_error", repr(e)

    with pytest.raises(anthropic.APIStatusError) as info:
        create(model="llama-3-8b", max_tokens=8, messages=HUGE)
    e = info.value
    assert e.status_code == 413, repr(e)
    assert kind(e) == "request_too_large"

    saturate(gateway)
    with pytest.raises(anthropic.RateLimitError) as info:
        create(model="llama-3-8b", max_tokens=8, messages=HI, extra_headers={"x-gateway-priority": "-1"})
    e = info.value
    assert kind(e) == "rate_limit_error", repr(e)

    # Anthropic's model list and model objects, from the same /v1/models.
    page = c.models.list()
    assert [m.id for m in page.data] == ["llama-3-8b", HF, "llama"]
    assert not page.has_more
    assert [m.id for m in page] == ["llama-3-8b", HF, "llama"]  # the SDK's pagination ends
    m = c.models.retrieve(HF)
    assert (m.id, m.type, m.display_name, m.created_at.year) == (HF, "model", HF, 1970)
    with pytest.raises(anthropic.NotFoundError) as info:
        c.models.retrieve("claude-9")
    assert kind(info.value) == "not_found_error", repr(info.value)
