"""envoy/check_configs.py's kustomize subset and its checks of the Envoy Gateway variant with the
dynamic module: what `make validate` relies on to say the variant is what Envoy Gateway and
kustomize would make of it."""

import copy
import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "envoy"))
import check_configs as cc  # noqa: E402

MODULE = ROOT / "target" / "release" / "libgpuroute.so"


def test_json_patch_operations_follow_rfc_6902():
    doc = {"a": {"list": [1, 2]}, "b": {"x": 1}}
    cc.rfc6902(doc, {"op": "add", "path": "/a/list/1", "value": 9})
    cc.rfc6902(doc, {"op": "add", "path": "/a/list/-", "value": 7})
    assert doc["a"]["list"] == [1, 9, 2, 7]
    cc.rfc6902(doc, {"op": "copy", "from": "/b", "path": "/c"})
    doc["c"]["x"] = 2  # a copy, not the same object
    assert doc["b"] == {"x": 1}
    cc.rfc6902(doc, {"op": "move", "from": "/c", "path": "/d"})
    assert "c" not in doc and doc["d"] == {"x": 2}
    cc.rfc6902(doc, {"op": "replace", "path": "/d/x", "value": 3})
    cc.rfc6902(doc, {"op": "test", "path": "/d/x", "value": 3})
    cc.rfc6902(doc, {"op": "remove", "path": "/a/list/0"})
    assert doc == {"a": {"list": [9, 2, 7]}, "b": {"x": 1}, "d": {"x": 3}}
    # kustomize's add does not create missing parents (Envoy Gateway's does; not here)
    with pytest.raises(cc.CheckError, match="does not exist"):
        cc.rfc6902(doc, {"op": "add", "path": "/nope/x", "value": 1})
    with pytest.raises(cc.CheckError, match="test /d/x"):
        cc.rfc6902(doc, {"op": "test", "path": "/d/x", "value": 4})
    with pytest.raises(cc.CheckError, match="no index"):
        cc.rfc6902(doc, {"op": "remove", "path": "/a/list/3"})
    with pytest.raises(cc.CheckError, match="not one of"):
        cc.rfc6902(doc, {"op": "merge", "path": "/a", "value": {}})


def by_kind(docs, kind):
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


def test_the_variant_loads_the_module_with_the_wasm_filters_configuration():
    base, variant = cc.kustomize(cc.EG_BASE), cc.kustomize(cc.EG_DYNAMIC)
    assert sorted(map(cc._doc_key, base)) == sorted(map(cc._doc_key, variant))
    wasm = by_kind(base, "EnvoyExtensionPolicy")["spec"]
    dm = by_kind(variant, "EnvoyExtensionPolicy")["spec"]
    assert "wasm" not in dm and dm["dynamicModule"][0]["config"] == wasm["wasm"][0]["config"]
    patches = by_kind(variant, "EnvoyPatchPolicy")["spec"]["jsonPatches"]
    assert [p["operation"]["path"] for p in patches] == [
        p["operation"]["path"] for p in by_kind(base, "EnvoyPatchPolicy")["spec"]["jsonPatches"][2:]
    ]
    assert not any("wasm" in str(p) for p in patches)
    # Everything else is the base's, untouched.
    untouched = {"EnvoyExtensionPolicy", "EnvoyPatchPolicy", "EnvoyProxy"}
    assert [d for d in base if d["kind"] not in untouched] == [d for d in variant if d["kind"] not in untouched]


def test_a_reordered_base_patch_policy_fails_the_build_rather_than_dropping_the_wrong_patches(tmp_path):
    shutil.copytree(cc.EG_BASE, tmp_path / "envoy-gateway")
    shutil.copytree(cc.EG_DYNAMIC, tmp_path / "variant")
    epp_file = tmp_path / "envoy-gateway" / "06-patch-policy.yaml"
    epp = yaml.safe_load(epp_file.read_text())
    epp["spec"]["jsonPatches"].reverse()
    epp_file.write_text(yaml.safe_dump(epp))
    with pytest.raises(cc.CheckError, match="patch-policy.yaml: test /spec/jsonPatches/0"):
        cc.kustomize(tmp_path / "variant")


def variant_docs(edit=None):
    docs = cc.kustomize(cc.EG_DYNAMIC)
    if edit:
        edit({d["kind"]: d for d in docs})
    return {"v/x": docs}


def fragment(docs):
    return cc.eg_fragment(docs, Path("/nonexistent.wasm"), prefix="v", module=MODULE)


def test_the_variant_becomes_the_dynamic_module_filter_envoy_gateway_generates():
    config, facts = fragment(variant_docs())
    hcm = config["static_resources"]["listeners"][0]["default_filter_chain"]["filters"][0]["typed_config"]
    f = hcm["http_filters"][0]
    assert f["name"] == "envoy.filters.http.dynamic_modules/envoyextensionpolicy/llm/gpuroute/dynamic-module/0"
    assert f["disabled"] and f["typed_config"]["dynamic_module_config"]["module"]["local"]["filename"] == str(MODULE)
    assert facts["runtime"] == "dynamic"
    # Every route enables it.
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert routes and all(f["name"] in r["typed_per_filter_config"] for r in routes)


def deployment(kinds):
    return kinds["EnvoyProxy"]["spec"]["provider"]["kubernetes"]["envoyDeployment"]


@pytest.mark.parametrize(
    "edit, error",
    [
        # The module is for Envoy 1.40; the distroless image lacks libgcc_s.so.1.
        (lambda k: deployment(k)["container"].update(image="docker.io/envoyproxy/envoy:v1.39.2"), "built for Envoy"),
        (lambda k: deployment(k)["container"].update(image="docker.io/envoyproxy/envoy:distroless-v1.40.0"),
         "built for Envoy"),
        (lambda k: deployment(k)["container"].pop("image"), "default image"),
        (lambda k: deployment(k).pop("initContainers"), "no init container writes libgpuroute.so"),
        (lambda k: deployment(k)["initContainers"][0].update(command=["cp", "/gpuroute/libgpuroute.so", "/tmp/"]),
         "no init container writes"),
        (lambda k: deployment(k)["pod"]["volumes"].clear(), "no volume 'gpuroute-module'"),
        (lambda k: deployment(k)["container"]["volumeMounts"].clear(), "no volume of the Envoy container"),
        (lambda k: k["EnvoyProxy"]["spec"].pop("dynamicModules"), "no single entry 'gpuroute'"),
        (lambda k: k["EnvoyProxy"]["spec"]["dynamicModules"][0]["source"]["local"].update(path="/x/libother.so"),
         "the build is libgpuroute.so"),
        # Both extensions at once, or none.
        (lambda k: k["EnvoyExtensionPolicy"]["spec"].update(wasm=[{"config": {}}]), "expected one extension"),
        (lambda k: k["EnvoyExtensionPolicy"]["spec"].pop("dynamicModule"), "expected one extension"),
    ],
)
def test_a_module_the_envoy_pod_would_not_have_or_could_not_load_fails(edit, error):
    with pytest.raises(cc.CheckError, match=error):
        fragment(variant_docs(edit))


def test_the_wasm_filters_patches_select_nothing_with_the_module():
    base_epp = by_kind(cc.kustomize(cc.EG_BASE), "EnvoyPatchPolicy")

    def keep_wasm_patches(k):
        k["EnvoyPatchPolicy"]["spec"] = copy.deepcopy(base_epp["spec"])

    with pytest.raises(cc.CheckError, match="selects nothing"):
        fragment(variant_docs(keep_wasm_patches))


def _stats_tags_in(text):
    """Every stats_tags list in a manifest's text, looking into strings that are YAML
    themselves (Envoy Gateway's bootstrap `value: |`)."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "stats_tags":
                    found.append(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, str) and "stats_tags:" in node:
            walk(yaml.safe_load(node))

    for doc in yaml.safe_load_all(text):
        walk(doc)
    return found


@pytest.mark.parametrize("path", cc.STATS_TAGS_COPIES, ids=lambda p: p.name)
def test_regenerating_the_stats_tags_rewrites_only_the_list(path):
    text = path.read_text()
    # The shipped copy is what regenerating writes, byte for byte.
    assert cc.sync_stats_tags(text, cc.render.STATS_TAGS) == text
    assert _stats_tags_in(text) == [cc.render.STATS_TAGS]

    # A changed list: a tag dropped, one added whose regex plain YAML would misread (a leading
    # `[`, a `: ` and a ` #`), one with a quote in it.
    tags = copy.deepcopy(cc.render.STATS_TAGS[1:])
    tags.append({"tag_name": "gpuroute_extra", "regex": r"[a-z]+: x #(\.y)'$"})
    tags.append({"tag_name": "it's", "regex": r"^a(\.b)$"})
    new = cc.sync_stats_tags(text, tags)
    assert _stats_tags_in(new) == [tags]
    # Outside the list, nothing moved: the lines before it and after it are the old ones.
    old_lines, new_lines = text.splitlines(), new.splitlines()
    start = next(i for i, line in enumerate(old_lines) if line.strip() == "stats_tags:")
    old_end = start + 1 + 2 * len(cc.render.STATS_TAGS)
    new_end = start + 1 + 2 * len(tags)
    assert new_lines[: start + 1] == old_lines[: start + 1]
    assert new_lines[new_end:] == old_lines[old_end:]
    # And back again.
    assert cc.sync_stats_tags(new, cc.render.STATS_TAGS) == text


def test_a_manifest_without_one_stats_tags_key_is_refused():
    with pytest.raises(cc.CheckError, match="found 0"):
        cc.sync_stats_tags("a: 1\n", cc.render.STATS_TAGS)
    with pytest.raises(cc.CheckError, match="found 2"):
        cc.sync_stats_tags("a:\n  stats_tags:\n  - x\nb:\n  stats_tags:\n  - y\n", cc.render.STATS_TAGS)


def with_pushed_limit(manifests, configmap, key, limit):
    """The manifests with the aggregator's push.max_snapshot_bytes set in each ConfigMap
    `configmap` (Envoy Gateway's and Istio's have the same name)."""
    manifests = copy.deepcopy(manifests)
    cms = [d for docs in manifests.values() for d in docs
           if d["kind"] == "ConfigMap" and d["metadata"]["name"] == configmap]
    assert cms, configmap
    for cm in cms:
        cfg = yaml.safe_load(cm["data"][key])
        cfg.setdefault("push", {})["max_snapshot_bytes"] = limit
        cm["data"][key] = yaml.safe_dump(cfg)
    return manifests


SHIPPED_PAIRS = {
    # flavour: (its manifests, the check, the aggregator's ConfigMap and key, the filter's limit)
    "envoy-gateway": (cc.load_manifests, lambda m: cc.eg_fragment(m, Path("/nonexistent.wasm")),
                      ("gpuroute-sidecar", "sidecar.yaml"), 5 * 1024 * 1024),
    "istio": (cc.load_manifests, lambda m: cc.istio_fragment(m, Path("/nonexistent.wasm")),
              ("gpuroute-sidecar", "sidecar.yaml"), 5 * 1024 * 1024),
    # deploy/kubernetes runs the local bootstrap, whose filter keeps the default 8 MiB.
    "kubernetes": (cc.k8s_manifests, cc.k8s_consistency,
                   ("gpuroute-sidecar-metrics", cc.K8S_SIDECAR_KEY), cc.DEFAULT_MAX_SNAPSHOT),
}


@pytest.mark.parametrize("flavour", SHIPPED_PAIRS)
def test_the_aggregator_never_pushes_a_snapshot_the_filter_would_refuse_whole(flavour):
    load, check, (configmap, key), filter_limit = SHIPPED_PAIRS[flavour]
    manifests = load()
    check(manifests)  # as shipped
    # Up to the filter's limit is fine; one byte over fails, naming both options.
    check(with_pushed_limit(manifests, configmap, key, filter_limit))
    with pytest.raises(cc.CheckError, match=f"push.max_snapshot_bytes {filter_limit + 1} is over the filter's "
                                            f"ingest.max_snapshot_bytes {filter_limit}"):
        check(with_pushed_limit(manifests, configmap, key, filter_limit + 1))


@pytest.mark.parametrize("models_path, hint", [(None, " or /v1/models"), ("/models", " or /models"), ("", "")])
def test_the_catch_all_404_names_the_models_path_the_filter_serves(models_path, hint):
    """The 404 of a path no route takes points at the filter's models path, or at none when it
    serves none (before, always at /v1/models: with models_path "/models" that path was the
    404 itself)."""
    fcfg = {"pools": [{"name": "p", "models": ["m"]}]}
    if models_path is not None:
        fcfg["models_path"] = models_path
    desc = {"mode": "filter", "pools": [{"name": "p", "endpoints": ["127.0.0.1:1"]}], "filter_config": fcfg,
            "listen": "127.0.0.1:1", "admin": "127.0.0.1:2", "wasm": "x.wasm"}
    listener = cc.render.render(desc)["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    last = hcm["route_config"]["virtual_hosts"][0]["routes"][-1]
    assert last["match"] == {"prefix": "/"}
    body = json.loads(last["direct_response"]["body"]["inline_string"])
    assert body["error"]["message"] == f"no route: use an OpenAI inference path{hint}"
