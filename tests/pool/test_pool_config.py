"""`PoolConfig`, the live pool's settings: bad values are refused naming the field, and every field says what it is."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pool.actor import EngineSpec
from pool.config import BACKENDS, PoolConfig


@pytest.mark.parametrize("field, value", [("backend", "carrier-pigeon"), ("gpu_share", 1.5), ("poll_s", 0.0),
                                          ("max_restarts", -1), ("call_timeout_s", 0.0), ("max_requests", 0)])
def test_a_bad_setting_is_refused_naming_the_field_and_the_value(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field) as raised:
        PoolConfig(**{field: value})
    assert repr(value) in str(raised.value) or str(value) in str(raised.value)


def test_an_unknown_setting_is_refused() -> None:
    with pytest.raises(ValidationError, match="stats_interval"):
        PoolConfig(stats_interval=1.0)  # a typo of stats_interval_s


def test_settings_are_frozen_and_keep_the_engine_spec_given() -> None:
    spec = EngineSpec("sim", {"time_scale": 0.0})
    config = PoolConfig(engine=spec, backend="threads", devices={"slot0": "cpu"})
    assert config.engine == spec and config.backend in BACKENDS and dict(config.devices) == {"slot0": "cpu"}
    with pytest.raises(ValidationError):
        config.backend = "ray"  # type: ignore[misc]


def test_every_setting_is_described() -> None:
    assert all(field.description for field in PoolConfig.model_fields.values())
    assert set(BACKENDS) == {"ray", "processes", "threads", "inprocess"}
