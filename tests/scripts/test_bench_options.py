"""The benchmark scripts' option parsing and sample classification: scripts/envoy_overhead.py's
--compare-config, scripts/envoy_profile.py's experiments and split of perf samples, and
scripts/wasm_instructions.py's reading of callgrind's per-instruction counts."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import envoy_overhead as eo  # noqa: E402
import envoy_profile as ep  # noqa: E402
import wasm_instructions as wi  # noqa: E402


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


def test_profile_experiments_are_their_reference_with_their_keys_changed():
    specs = eo.gateway_specs(Addresses(), eo.CONFIG, {}, floor_callbacks=True)
    got, pairs = ep.experiment_specs(specs, {"spin": {"floor_spin": 6000}}, {"nofb": {"fallback_endpoints": 0}},
                                     {"small": Path("/x/small.wasm")})
    assert list(got) == [*ep.GATEWAYS, "spin", "nofb", "small"]
    # The experiments are the floor and the filter with one key more or changed; nothing else.
    assert got["spin"] == dict(specs["wasm_floor"], wasm=ep.FLOOR_EXPERIMENTS_WASM,
                               filter_config=dict(specs["wasm_floor"]["filter_config"], floor_spin=6000))
    assert got["nofb"]["filter_config"] == dict(eo.CONFIG, fallback_endpoints=0)
    assert got["nofb"]["runtime"] == "wasm" and "wasm" not in got["nofb"]
    # The references are untouched.
    assert "floor_spin" not in got["wasm_floor"]["filter_config"]
    assert got["wasm_floor"]["wasm"] == eo.FLOOR_WASM
    assert got["filter"]["filter_config"] == eo.CONFIG
    assert got["small"] == dict(specs["filter"], wasm=Path("/x/small.wasm"))
    assert pairs == [("filter", "floor_callbacks"), ("spin", "wasm_floor"), ("nofb", "filter"), ("small", "filter")]


CALLGRIND = """positions: instr line
events: Ir
fn=(1) f
0x1000 1 5
+4 * 3
+60 * 2
cfn=(2) memory_copy_wrapper
calls=2 0x9000
+4 * 100
fn=(3) g
0x2010 1 7
0x5000 1 9
"""


def test_callgrind_counts_are_given_to_functions_and_their_lines(tmp_path):
    cg = tmp_path / "cg.out"
    cg.write_text(CALLGRIND)
    own, lines, copies = wi.count(cg, [(0x1000, 0x100, "f"), (0x2000, 0x80, "g")])
    # A call's inclusive cost is not the caller's own; an address outside every range is no one's.
    assert own == {"f": 10, "g": 7}
    # Lines are named by their function and offset: 0x1000 and 0x1004 share one, 0x1040 is the next.
    assert lines == {("f", 0): 8, ("f", 64): 2, ("g", 0): 7}
    assert copies == {"f": 2}


@pytest.mark.parametrize("name, want", [
    ("proxy_on_request_headers", True),
    ("_RNvNtNtCsdHhIpgkcIfN_4core3str8converts9from_utf8", True),
    ("_ZN15gpuroute_filter4Http5route17h0123456789abcdefE", True),
    ("Builtin:WasmToJs", False),
    ("wasm-to-js:iii:i", False),
    ("js-to-wasm:i:i", False),
    ("main file:///x/wasm_profile.mjs:12:3", False),
])
def test_only_wasm_functions_count_as_the_filter_code(name, want):
    # V8 logs a wasm function under its export or (mangled) symbol name, its other code by kind.
    assert wi.is_wasm(name) is want
