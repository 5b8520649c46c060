"""The model replicas' Serve options carry the OpenMP and malloc settings their engine thread
needs (`REPLICA_ENV_DEFAULTS`, docs/benchmarks.md), under what `replica.env_vars` sets."""

from __future__ import annotations

from sessionserve.app import replica_options
from sessionserve.config import REPLICA_ENV_DEFAULTS, AppConfig


def _env(args: dict) -> dict[str, str]:
    return replica_options(AppConfig.model_validate(args))["ray_actor_options"]["runtime_env"][
        "env_vars"
    ]


def test_replicas_get_the_environment_defaults() -> None:
    assert (
        _env({})
        == REPLICA_ENV_DEFAULTS
        == {
            "OMP_WAIT_POLICY": "ACTIVE",
            "GOMP_SPINCOUNT": "300000",
            "MALLOC_ARENA_MAX": "1024",
        }
    )


def test_env_vars_add_to_them_and_override_them_key_by_key() -> None:
    env = _env({"replica": {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE", "X": "1"}}})
    assert env == {
        "OMP_WAIT_POLICY": "PASSIVE",
        "GOMP_SPINCOUNT": "300000",
        "MALLOC_ARENA_MAX": "1024",
        "X": "1",
    }
