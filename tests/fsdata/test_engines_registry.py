"""Engines are registered by name and every command reaches one through the registry; the
pre-flight of :meth:`fsdata.engines.base.Engine.run` runs once, before any stage."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import fsdata
from fsdata.balancer.settings import BalanceSettings
from fsdata.cli import main
from fsdata.engines import base, get_engine, names
from fsdata.engines.local import LocalEngine
from fsdata.errors import ConfigError
from tests.fsdata.helpers import write_samples


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    return write_samples(tmp_path_factory.mktemp("in") / "in", n=300, num_files=2)


@pytest.fixture
def spy():
    """A local engine registered as ``spy`` that counts its pre-flight and stage calls."""
    calls: dict[str, int] = {}

    @base.register("spy")
    class Spy(LocalEngine):
        def open_input(self, *a, **k):
            calls["open_input"] = calls.get("open_input", 0) + 1
            return super().open_input(*a, **k)

        def plan(self, *a, **k):
            calls["plan"] = calls.get("plan", 0) + 1
            return super().plan(*a, **k)

        def write_ranks(self, *a, **k):
            calls["write_ranks"] = calls.get("write_ranks", 0) + 1
            return super().write_ranks(*a, **k)

    yield calls
    base.ENGINES.unregister("spy")


def _settings(**kw) -> BalanceSettings:
    return BalanceSettings(**{"num_ranks": 4, "batch_size_per_rank": 8, "progress": False, **kw})


def test_registered_engines_are_the_settings_choices():
    assert names()[:2] == ("local", "ray")
    from fsdata.cli import parse_args

    assert BalanceSettings(num_ranks=1, batch_size_per_rank=1).engine in names()
    for name in names():  # the --engine choices are the registry's
        assert parse_args(["balance", "in.parquet", "out", "--ranks", "1", "--batch-size-per-rank", "1",
                           "--engine", name]).balance.engine == name
    assert type(get_engine(_settings(engine="local"))).__name__ == "LocalEngine"
    assert type(get_engine(_settings(engine="ray"))).__name__ == "RayEngine"  # Ray is imported only by run()


def test_unknown_engine_is_one_config_error():
    with pytest.raises(ConfigError, match="unknown .*engine.* 'nope'; use one of local, ray"):
        fsdata.balance("in", "out", _settings(engine="nope"))


def test_a_registered_engine_is_reached_by_balance_and_write(samples, tmp_path, spy):
    fsdata.balance(samples, tmp_path / "local", _settings())
    fsdata.balance(samples, tmp_path / "spy", _settings(engine="spy"))
    assert spy == {"open_input": 1, "plan": 1, "write_ranks": 1}  # the pre-flight opened the input once
    assert _digests(tmp_path / "spy") == _digests(tmp_path / "local")
    plan = tmp_path / "plan.parquet"
    assert main(["plan", str(samples), str(plan), "--ranks", "4", "--batch-size-per-rank", "8", "--no-progress"]) == 0
    spy.clear()
    files = base.write_from_plan(samples, plan, tmp_path / "staged", engine="spy", progress=False)
    assert spy == {"open_input": 1, "write_ranks": 1} and len(files) == 4
    for f in files:
        assert f.sha256 == hashlib.sha256((tmp_path / "local" / f.path).read_bytes()).hexdigest()


def test_preflight_refuses_before_any_stage(samples, tmp_path, spy):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "x").write_text("x")
    with pytest.raises(ConfigError, match="already exists"):
        fsdata.balance(samples, out, _settings(engine="spy"))
    with pytest.raises(ConfigError, match="OUTPUT"):
        fsdata.balance(samples, samples / "inside", _settings(engine="spy"))
    with pytest.raises(ConfigError, match="epochs"):
        fsdata.balance(samples, tmp_path / "o", _settings(engine="spy", epochs=0))
    assert spy == {}  # nothing opened, planned or written
    assert not (tmp_path / "o").exists() and not (samples / "inside").exists()


def test_an_engine_that_writes_one_epoch_refuses_more_before_reading(samples, tmp_path):
    with pytest.raises(ConfigError, match="--epochs 2 is not supported by --engine ray"):
        fsdata.balance(samples, tmp_path / "o", _settings(engine="ray", epochs=2))
