"""The benchmark scripts' option parsing and sample classification: scripts/envoy_overhead.py's
--compare-config and scripts/envoy_profile.py's split of perf samples."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import envoy_overhead as eo  # noqa: E402
import envoy_profile as ep  # noqa: E402


class Addresses:
    """What gateway_specs reads of the upstream: its pods' addresses."""

    def addresses(self):
        return ["127.0.0.1:1", "127.0.0.1:2"]


def test_compare_config_reads_names_and_configuration_changes():
    got = eo.compare_configs(['slow={"tick_ms": 1000}', 'quiet={"shared_refresh_ms": 5, "debug_header": true}'],
                             {"copy"})
    assert got == {"slow": {"tick_ms": 1000}, "quiet": {"shared_refresh_ms": 5, "debug_header": True}}


@pytest.mark.parametrize("spec", ['slow', 'slow=', '={"tick_ms": 1}', 'slow={"tick_ms": ', 'slow=[1, 2]',
                                  'slow="tick_ms"', 'copy={}', 'filter={}'])
def test_compare_config_refuses_a_malformed_or_taken_spec(spec):
    with pytest.raises(SystemExit):
        eo.compare_configs([spec], {"copy", *eo.GATEWAYS})


def test_compare_config_refuses_a_name_twice():
    with pytest.raises(SystemExit):
        eo.compare_configs(['a={}', 'a={"tick_ms": 2}'], set())


def test_a_configuration_build_changes_only_its_own_keys():
    wasm = Path("/x/filter.wasm")
    config = dict(eo.CONFIG, tick_ms=20)
    specs = eo.gateway_specs(Addresses(), config, {"copy": wasm, "slow": wasm}, configs={"slow": {"tick_ms": 1000}})
    assert specs["slow"]["filter_config"] == dict(config, tick_ms=1000)
    assert specs["slow"]["wasm"] == wasm and specs["slow"]["runtime"] == "wasm"
    # the others keep the configuration they had
    assert specs["copy"]["filter_config"] == config
    assert specs["filter"]["filter_config"] == config
    assert config["tick_ms"] == 20


ENVOY = "/venv/lib/python3.11/site-packages/envoy/_bin/envoy"
JIT = "/tmp/perf-123.map"


@pytest.mark.parametrize("frames, want", [
    ([JIT, ENVOY, ENVOY], "wasm (JIT)"),
    ([ENVOY, ENVOY, JIT, ENVOY], "envoy, for the VM"),
    (["inlined", ENVOY, JIT], "envoy, for the VM"),
    ([ENVOY, ENVOY, "[unknown]"], "envoy"),
    (["[unknown]"], "envoy"),
    (["inlined", JIT], "wasm (JIT)"),
    (["[kernel.kallsyms]", ENVOY, JIT], "kernel"),
    (["/usr/lib/x86_64-linux-gnu/libc.so.6", JIT], "libc"),
    (["[vdso]"], "other"),
    (["inlined"], "other"),
])
def test_a_sample_is_classed_by_its_leaf_and_whether_wasm_code_called_it(frames, want):
    assert ep.classify(frames) == want


def test_samples_are_split_by_process_and_class():
    text = f"""
    101 
\t    7f00 [unknown] ({JIT})
\t    5f00 [unknown] ({ENVOY})

    101 
\t    5f10 [unknown] ({ENVOY})
\t    7f10 [unknown] ({JIT})

    101 
\t    5f20 [unknown] ({ENVOY})
\t    5f30 [unknown] ({ENVOY})

    202 
\t    ffff [unknown] ([kernel.kallsyms])

    202 
\t    5f20 [unknown] ({ENVOY})
"""
    got = ep.split_text(text)
    assert set(got) == {101, 202}
    assert got[101]["wasm (JIT)"] == pytest.approx(1 / 3)
    assert got[101]["envoy, for the VM"] == pytest.approx(1 / 3)
    assert got[101]["envoy"] == pytest.approx(1 / 3)
    assert got[202] == dict(dict.fromkeys(ep.CLASSES, 0.0), kernel=0.5, envoy=0.5)
