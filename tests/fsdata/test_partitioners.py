"""The Partitioner role (fsdata.balancer.partitioners): the registry, and injection into make_plan."""

import numpy as np
import pytest

from fsdata.balancer import partitioners
from fsdata.balancer.partitioners import Partitioner, StepPartitioner, get_partitioner, names, partition_steps, register
from fsdata.balancer.plan import make_plan
from fsdata.errors import ConfigError


def test_every_built_in_name_is_registered():
    assert names() == ("shuffle", "roundrobin", "kk", "lpt", "lpt-swap", "lpt-swap-cpsat", "auto")
    for name in names():
        p = get_partitioner(name)
        assert isinstance(p, Partitioner) and p.name == name


def test_unknown_name_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown partition method 'greedy'"):
        get_partitioner("greedy")


@pytest.mark.parametrize("name", ["lpt-swap", "kk", "auto"])
def test_an_injected_instance_plans_exactly_as_its_name(name):
    costs = np.random.default_rng(3).lognormal(0.0, 1.0, 4 * 8 * 12)
    by_name = make_plan(costs, num_ranks=4, batch_size_per_rank=8, seed=1, partitioner=name)
    by_instance = make_plan(costs, num_ranks=4, batch_size_per_rank=8, seed=1, partitioner=get_partitioner(name))
    np.testing.assert_array_equal(by_name.rank, by_instance.rank)
    np.testing.assert_array_equal(by_name.step, by_instance.step)
    assert by_name.partition_info == by_instance.partition_info


class _Reversed(StepPartitioner):
    """A partitioner from outside the registry: rank = R - 1 - position // B."""

    name = "reversed"

    def partition_steps(self, c, R, B):
        return np.broadcast_to((R - 1 - np.arange(R * B) // B).astype(np.int32), c.shape).copy()


def test_make_plan_uses_the_injected_partitioner():
    costs = np.arange(2 * 3 * 4, dtype=np.float64)
    plan = make_plan(costs, num_ranks=2, batch_size_per_rank=3, seed=0, compose_window=1, partitioner=_Reversed())
    baseline = make_plan(costs, num_ranks=2, batch_size_per_rank=3, seed=0, compose_window=1, partitioner="shuffle")
    kept = plan.step >= 0
    np.testing.assert_array_equal(plan.rank[kept], 1 - baseline.rank[kept])
    assert plan.partition_info == {"method": "reversed"}


@pytest.fixture
def registered_reversed(monkeypatch):
    """``reversed`` registered by name for one test (the registry is restored afterwards)."""
    @register("reversed")
    class Reversed(_Reversed):
        pass

    yield Reversed
    partitioners.PARTITIONERS.unregister("reversed")


def test_a_newly_registered_partitioner_is_accepted_and_listed(registered_reversed, tmp_path, capsys):
    """The registry is the one list of names: a partitioner registered from outside is listed, and
    partition_steps, make_plan, fsdata.balance, verify (plan recomputed from the input) and the
    --partitioner choices accept it."""
    assert names()[-1] == "reversed"
    R, B = 2, 3
    costs = np.arange(4 * R * B, dtype=np.float64)
    ranks = partition_steps(costs.reshape(4, R * B), R, B, "reversed")
    np.testing.assert_array_equal(ranks, np.broadcast_to(R - 1 - np.arange(R * B) // B, (4, R * B)))
    plan = make_plan(costs, num_ranks=R, batch_size_per_rank=B, seed=0, compose_window=1, partitioner="reversed")
    assert plan.partition_info == {"method": "reversed"}

    import fsdata
    from fsdata.cli import parse_args
    from fsdata.shards.verify import verify
    from tests.fsdata.helpers import write_samples

    inp = write_samples(tmp_path / "in.parquet", n=200)
    m = fsdata.balance(inp, tmp_path / "out", fsdata.BalanceSettings(
        num_ranks=R, batch_size_per_rank=B, partitioner="reversed", compose_window=1, progress=False))
    assert m.settings["partitioner"] == "reversed" and m.settings["partition_info"] == {"method": "reversed"}
    assert verify(tmp_path / "out", inp)["checked_input"]

    args = parse_args(["plan", "in.parquet", "plan.parquet", "--ranks", "2", "--batch-size-per-rank", "3",
                       "--partitioner", "reversed"])
    assert args.balance.partitioner == "reversed"
    with pytest.raises(SystemExit) as e:
        parse_args(["plan", "in.parquet", "plan.parquet", "--ranks", "2", "--batch-size-per-rank",
                                   "3", "--partitioner", "greedy"])
    assert e.value.code == 2 and "reversed" in capsys.readouterr().err  # the choices shown are the registry's


def test_an_unregistered_name_is_refused_everywhere():
    with pytest.raises(ConfigError, match="unknown partition method 'reversed'"):
        partition_steps(np.ones((1, 6)), 2, 3, "reversed")
    with pytest.raises(ConfigError, match="unknown (--)?partitioner 'reversed'"):
        make_plan(np.ones(12), num_ranks=2, batch_size_per_rank=3, partitioner="reversed")
