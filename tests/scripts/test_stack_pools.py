"""scripts/stack.py's filter configuration of a fleet's pools: a scenario's `pools` settings go
over what the fleet gives each pool (the offline replay's `filter_config` does the same,
bench/tests/replay.rs), and a setting for a pool the fleet does not have is refused."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import stack  # noqa: E402

FLEET_POOLS = [
    {"name": "steady", "models": ["m"], "adapters": ["a"], "endpoints": ["127.0.0.1:1"], "pods": []},
    {"name": "burst", "models": ["m"], "adapters": [], "endpoints": ["127.0.0.1:2"], "pods": []},
]


def test_a_pools_settings_go_over_what_the_fleet_gives_it():
    got = stack.filter_pools(FLEET_POOLS, {"steady": {"failover": ["burst"], "overflow": True},
                                           "burst": {"models": []}})
    assert got == [
        {"name": "steady", "models": ["m"], "adapters": ["a"], "failover": ["burst"], "overflow": True},
        {"name": "burst", "models": [], "adapters": []},
    ]


def test_without_settings_each_pool_is_what_the_fleet_gives():
    assert stack.filter_pools(FLEET_POOLS, {}) == [
        {"name": "steady", "models": ["m"], "adapters": ["a"]},
        {"name": "burst", "models": ["m"], "adapters": []},
    ]


def test_settings_for_a_pool_the_fleet_does_not_have_are_refused():
    with pytest.raises(SystemExit, match="stedy"):
        stack.filter_pools(FLEET_POOLS, {"stedy": {"overflow": True}})
