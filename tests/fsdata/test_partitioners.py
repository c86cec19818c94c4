"""The Partitioner role (fsdata.balancer.partitioners): the registry, and injection into make_plan."""

import numpy as np
import pytest

from fsdata.balancer.partition import METHODS
from fsdata.balancer.partitioners import Partitioner, StepPartitioner, get_partitioner, names
from fsdata.balancer.plan import PARTITIONERS, make_plan
from fsdata.errors import ConfigError


def test_every_planning_name_is_registered():
    assert names() == (*METHODS, "auto")
    assert set(names()) == set(PARTITIONERS)
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
