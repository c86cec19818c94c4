"""Hierarchical all-to-all-v (shm / copy engines inside a node, gloo / NCCL across).

Single process: the routing core (:mod:`fstrain.distributed.comm.hierarchical`) driven by one thread per rank
over in-process exchanges equals a plain all-to-all for many layouts (contiguous, interleaved,
single-rank nodes) and random uneven splits with zeros. Multi-process (``multiproc``): 4 ranks as
2 "nodes" of 2 (``FSTRAIN_NODE_ID``) on the ``fs_shm`` process group equal gloo's
``all_to_all_single`` bitwise, call after call, also for interleaved and 3-node layouts,
torchrec's pooled all-to-all (forward and backward) and a row-wise sharded EmbeddingCollection.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from fstrain.distributed.comm.base import CommBackend
from fstrain.distributed.comm.hierarchical import (NODE_ID_ENV, HierarchicalAllToAll, NodeLayout, gather_rows,
                                                   node_key, plan_route, scatter_rows)


def _reference(inputs: list[torch.Tensor], m: list[list[int]]) -> list[torch.Tensor]:
    """Plain all-to-all-v: ``m[p][q]`` rows from rank p to rank q."""
    w = len(m)
    outs = []
    for q in range(w):
        parts = []
        for p in range(w):
            off = sum(m[p][:q])
            parts.append(inputs[p][off:off + m[p][q]])
        outs.append(torch.cat(parts))
    return outs


class _Exchange:
    """An all-to-all among threads (one per member), for the single-process tests."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n)
        self.slots: dict[int, tuple[torch.Tensor, list[int]]] = {}

    def run(self, me: int, input: torch.Tensor, input_splits: list[int], output_splits: list[int]) -> torch.Tensor:
        self.slots[me] = (input, list(input_splits))
        self.barrier.wait()
        parts = []
        for p in range(len(output_splits)):
            x, splits = self.slots[p]
            assert splits[me] == output_splits[p], "split mismatch in the simulation"
            off = sum(splits[:me])
            parts.append(x[off:off + splits[me]])
        self.barrier.wait()
        return torch.cat(parts)


class _ThreadTransport(CommBackend):
    name = "threads"

    def __init__(self, exchange: _Exchange, rank: int, world_size: int):
        super().__init__(rank=rank, world_size=world_size)
        self.exchange = exchange

    def all_to_all_v(self, input, output_splits, input_splits, *, out=None):
        got = self.exchange.run(self.rank, input, input_splits, output_splits)
        if out is None:
            return got
        out.copy_(got)
        return out


class _Done:
    def wait(self):
        return True


def _run_threads(node_of: list[int], m: list[list[int]], trailing=(3,), dtype=torch.float32, calls=1):
    w = len(node_of)
    layouts = [NodeLayout(tuple(node_of), r) for r in range(w)]
    inter = _Exchange(w)
    intra = {n: _Exchange(len(layouts[0].nodes[n])) for n in range(layouts[0].num_nodes)}
    g = torch.Generator().manual_seed(sum(map(sum, m)))
    inputs = [(torch.randn(sum(m[p]), *trailing, generator=g) * 100).to(dtype) for p in range(w)]
    results: dict[int, list[torch.Tensor]] = {}
    errors = []

    def rank_fn(r):
        try:
            lay = layouts[r]
            transport = (_ThreadTransport(intra[lay.node_index], lay.local_index, len(lay.local_ranks))
                         if len(lay.local_ranks) > 1 else None)

            def inter_fn(out, inp, out_splits, in_splits):
                out.copy_(inter.run(r, inp, in_splits, out_splits))
                return _Done()

            h = HierarchicalAllToAll(lay, transport, inter_fn)
            outs = []
            for _ in range(calls):
                out = torch.full((sum(m[p][r] for p in range(w)), *trailing), -7).to(dtype)
                h(out, inputs[r], [m[p][r] for p in range(w)], m[r])
                outs.append(out)
            results[r] = outs
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            inter.barrier.abort()
            for ex in intra.values():
                ex.barrier.abort()

    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(w)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    ref = _reference(inputs, m)
    for r in range(w):
        for out in results[r]:
            assert torch.equal(out, ref[r]), (node_of, r)


_LAYOUTS = {
    "2x2 contiguous": [0, 0, 1, 1],
    "2x2 interleaved": [0, 1, 0, 1],
    "1+2+1": [0, 1, 1, 2],
    "singletons": [0, 1, 2],
    "3+2 mixed": [0, 1, 0, 0, 1],
    "one node": [0, 0, 0],
}


@pytest.mark.parametrize("name", list(_LAYOUTS))
def test_hierarchical_routing_equals_plain_all_to_all(name):
    node_of = _LAYOUTS[name]
    w = len(node_of)
    g = torch.Generator().manual_seed(w * 31 + len(name))
    for trial in range(4):
        m = torch.randint(0, 7, (w, w), generator=g)
        m[torch.rand(w, w, generator=g) < 0.3] = 0  # zero rows to / from some peers
        if trial == 1:
            m[0, :] = 0  # rank 0 sends nothing
        if trial == 2:
            m[:, w - 1] = 0  # the last rank receives nothing
        _run_threads(node_of, m.tolist(), trailing=(3,) if trial % 2 else (), calls=2)
    _run_threads(node_of, [[0] * w for _ in range(w)])  # all empty


def test_route_puts_every_row_on_one_part():
    lay = NodeLayout((0, 1, 0, 1), rank=2)
    assert lay.local_ranks == [0, 2] and lay.remote_ranks == [1, 3] and lay.local_index == 1
    route = plan_route(lay, [1, 2, 3, 4], [5, 6, 7, 8])
    assert route.intra_input_splits == [1, 3] and route.intra_output_splits == [5, 7]
    assert route.inter_input_splits == [0, 2, 0, 4] and route.inter_output_splits == [0, 6, 0, 8]
    assert route.send_offsets == [0, 1, 3, 6, 10]


def test_gather_is_a_view_for_consecutive_ranks_and_scatter_inverts_it():
    x = torch.arange(20).reshape(10, 2)
    offsets = [0, 2, 5, 5, 10]
    view = gather_rows(x, offsets, [1, 2, 3])
    assert view.data_ptr() == x[2:].data_ptr()  # no copy
    picked = gather_rows(x, offsets, [0, 3])
    assert torch.equal(picked, torch.cat([x[0:2], x[5:10]]))
    out = torch.zeros_like(x)
    scatter_rows(picked, out, offsets, [0, 3])
    scatter_rows(gather_rows(x, offsets, [1, 2]), out, offsets, [1, 2])
    assert torch.equal(out, x)


def test_layout_from_node_keys_and_the_override(monkeypatch):
    lay = NodeLayout.from_keys(["b", "a", "b", "c"], rank=3)
    assert lay.node_of == (0, 1, 0, 2) and lay.nodes == [[0, 2], [1], [3]] and lay.num_nodes == 3
    assert lay.digest() == NodeLayout.from_keys(["x", "y", "x", "z"], 0).digest()
    assert lay.digest() != NodeLayout((0, 0, 1, 1), 0).digest()
    monkeypatch.delenv(NODE_ID_ENV, raising=False)
    host = node_key()
    monkeypatch.setenv(NODE_ID_ENV, "n7")
    assert node_key() == "env:n7" != host


def test_mismatched_intra_transport_is_refused():
    lay = NodeLayout((0, 0, 1, 1), rank=1)
    with pytest.raises(ValueError, match="rank 0 of 2"):
        HierarchicalAllToAll(lay, _ThreadTransport(_Exchange(2), 0, 2), lambda *a: _Done())
    with pytest.raises(ValueError, match="need an intra-node transport"):
        HierarchicalAllToAll(lay, None, lambda *a: _Done())


# --------------------------------------------------------------------------------------------
# Multi-process: the fs_shm process group over 2 "nodes" x 2 ranks equals gloo


def _cases(world_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = world_size
    for i in range(4):
        m = torch.randint(0, 30, (w, w), generator=g)
        m[torch.rand(w, w, generator=g) < 0.25] = 0
        yield f"random{i}", m.tolist(), (5,), torch.float32
    m = torch.randint(0, 9, (w, w), generator=g)
    m[0, :] = 0
    m[:, w - 1] = 0
    yield "zeros", m.tolist(), (3,), torch.int64
    yield "all_empty", [[0] * w for _ in range(w)], (4,), torch.float32
    yield "1d", torch.randint(0, 4, (w, w), generator=g).tolist(), (), torch.int64
    yield "bf16", torch.randint(0, 50, (w, w), generator=g).tolist(), (16,), torch.bfloat16
    yield "large", torch.randint(2000, 4000, (w, w), generator=g).tolist(), (64,), torch.float32


def _check_against_gloo(rank, group, gloo, seed):
    import os

    w = dist.get_world_size(group)
    checked = 0
    for name, m, trailing, dtype in _cases(w, seed):
        in_splits, out_splits = m[rank], [m[p][rank] for p in range(w)]
        x = (torch.randn(sum(in_splits), *trailing) * 1000).to(dtype) + rank
        ref = torch.empty(sum(out_splits), *trailing, dtype=dtype)
        dist.all_to_all_single(ref, x, out_splits, in_splits, group=gloo)
        got = torch.full_like(ref, -7)
        dist.all_to_all_single(got, x, out_splits, in_splits, group=group)
        assert torch.equal(got, ref), f"{os.environ[NODE_ID_ENV]}: {name} differs from gloo"
        strided = torch.full((ref.shape[0], 2, *trailing), -7, dtype=dtype)[:, 0]  # non-contiguous output
        dist.all_to_all_single(strided, x, out_splits, in_splits, group=group)
        assert torch.equal(strided, ref), f"{name}: non-contiguous output differs from gloo"
        checked += 1
    return checked


def _row_wise_lookup(rank, world_size):
    """A row-wise sharded EmbeddingCollection under DMP on the default (hierarchical) group."""
    import logging

    logging.disable(logging.WARNING)
    from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv, ShardingType

    num_rows, dim = 100, 4
    pg = dist.group.WORLD
    ec = EmbeddingCollection(tables=[EmbeddingConfig(name="t0", embedding_dim=dim, num_embeddings=num_rows,
                                                     feature_names=["f0"])], device=torch.device("meta"))
    sharders = [EmbeddingCollectionSharder()]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        constraints={"t0": ParameterConstraints(sharding_types=[ShardingType.ROW_WISE.value])})
    plan = planner.collective_plan(ec, sharders, pg)
    dmp = DistributedModelParallel(ec, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                   plan=plan, sharders=sharders)

    def expected(ids):
        return ids.to(torch.float32)[:, None] + torch.arange(dim, dtype=torch.float32) / 1000

    for shard in dmp.state_dict()["embeddings.t0.weight"].local_shards():
        first = shard.metadata.shard_offsets[0]
        shard.tensor.copy_(expected(torch.arange(first, first + shard.tensor.shape[0])))
    before = (pg.num_shm_all_to_all, pg.hierarchical.inter_rows)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, num_rows, (3 + 2 * rank,), generator=g)  # uneven, every shard, repeats
    lengths = torch.tensor([1, 0, 2 + 2 * rank])
    out = dmp(KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=ids, lengths=lengths))["f0"]
    assert torch.equal(out.lengths(), lengths)
    assert torch.allclose(out.values(), expected(ids)), (out.values(), ids)
    return pg.num_shm_all_to_all - before[0], pg.hierarchical.inter_rows - before[1]


def _hierarchical_worker():
    import os

    from fstrain.distributed.comm import CommConfig, register_torch_backends
    from fstrain.distributed.comm.process_group import ShmProcessGroup
    from fstrain.distributed.comm.shm import ShmBackend

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ[NODE_ID_ENV] = f"node{rank // 2}"  # 2 "nodes" x 2 ranks
    cfg = ShmBackend.Config(chunk_bytes=1 << 14, num_slots=2, timeout_seconds=30)
    name = register_torch_backends(CommConfig(backend="shm", shm=cfg))
    from datetime import timedelta

    dist.init_process_group(name, timeout=timedelta(seconds=60))
    pg = dist.group.WORLD
    assert isinstance(pg, ShmProcessGroup) and pg.hierarchical is not None
    assert pg.layout.nodes == [[0, 1], [2, 3]] and pg.transport.world_size == 2
    gloo = dist.new_group(backend="gloo")
    out = {"2x2": _check_against_gloo(rank, pg, gloo, seed=1)}
    out["2x2 again"] = _check_against_gloo(rank, pg, gloo, seed=2)  # several calls, same group
    # torchrec's pooled-embedding all-to-all, forward and backward
    from torchrec.distributed.comm_ops import alltoall_pooled

    batch_per_rank, dim_sum_per_rank = [3, 5, 0, 4], [4, 6, 1, 8]
    pooled = {}
    for tag, g in (("hier", pg), ("gloo", gloo)):
        torch.manual_seed(rank)
        emb = torch.randn(sum(batch_per_rank), dim_sum_per_rank[rank], requires_grad=True)
        y = alltoall_pooled(emb, batch_per_rank, dim_sum_per_rank, group=g).wait()
        (y * torch.arange(y.numel()).reshape(y.shape)).sum().backward()
        pooled[tag] = (y.detach(), emb.grad)
    assert torch.equal(pooled["hier"][0], pooled["gloo"][0]), "alltoall_pooled forward"
    assert torch.equal(pooled["hier"][1], pooled["gloo"][1]), "alltoall_pooled backward"
    out["lookup"] = _row_wise_lookup(rank, world_size)
    # other layouts: groups made after changing the override (read when a group is built)
    for tag, node in (("interleaved", rank % 2), ("1+2+1", [0, 1, 1, 2][rank])):
        os.environ[NODE_ID_ENV] = f"node{node}"
        group = dist.new_group(backend="fs_shm")
        assert group.layout.node_of == ((0, 1, 0, 1) if tag == "interleaved" else (0, 1, 1, 2))
        out[tag] = _check_against_gloo(rank, group, gloo, seed=3)
        out[tag + " rows"] = (group.hierarchical.intra_rows, group.hierarchical.inter_rows)
    out["calls"] = pg.num_shm_all_to_all
    # one rank cannot build its node-local transport: every rank raises, none hangs (last: the failed
    # group creation leaves nothing usable behind)
    from fstrain.distributed.comm import BackendUnavailableError

    os.environ[NODE_ID_ENV] = f"node{rank // 2}"
    bad = ShmBackend.Config(timeout_seconds=3, shm_dir="/nonexistent" if rank == 3 else "/dev/shm")
    register_torch_backends(CommConfig(backend="shm", shm=bad))
    try:
        dist.new_group(backend="fs_shm")
        out["setup error"] = None
    except BackendUnavailableError as e:
        out["setup error"] = str(e)
    return out


@pytest.mark.multiproc
def test_fs_shm_on_two_nodes_of_two_equals_gloo():
    import glob

    from tests.fstrain.multiproc import run_ranks

    before = set(glob.glob("/dev/shm/fsc-*"))
    results = run_ranks(_hierarchical_worker, 4)
    for rank, res in enumerate(results):
        for tag in ("2x2", "2x2 again", "interleaved", "1+2+1"):
            assert res[tag] == 9, (rank, tag, res)
        calls, inter_rows = res["lookup"]
        assert calls >= 2 and inter_rows > 0, res["lookup"]  # torchrec's dists went through both parts
        intra_rows, inter_rows = res["1+2+1 rows"]
        assert intra_rows > 0 and inter_rows > 0
        assert "could not be set up on every rank" in (res["setup error"] or ""), res["setup error"]
    assert "shm_dir /nonexistent does not exist" in results[3]["setup error"]
    assert "PeerTimeoutError" in results[2]["setup error"]  # its node peer waited for it, then agreed
    assert set(glob.glob("/dev/shm/fsc-*")) == before, "shared-memory segments left behind"


def _train_worker(shards, backend, pipeline):
    import os

    from fstrain.distributed.env import init_distributed
    from fstrain.distributed.sharding import local_state
    from fstrain.config import from_dict
    from fstrain.train import train

    rank = int(os.environ["RANK"])
    if int(os.environ["WORLD_SIZE"]) > 1:
        os.environ[NODE_ID_ENV] = f"node{rank // 2}"  # 2 "nodes" x 2 ranks
    init_distributed(backend)
    pg = dist.group.WORLD
    res = train(from_dict({"shards": shards, "model": dict(embedding_dim=8, num_negatives=4, num_layers=1, num_heads=2),
                           "max_steps": 3, "metrics.log_every_steps": 0, "pipeline.name": pipeline or "none"}))
    hier = getattr(pg, "hierarchical", None)
    return local_state(res.model), (hier.num_calls, hier.inter_rows) if hier is not None else None


@pytest.mark.multiproc
def test_train_backend_shm_on_two_nodes_equals_one_rank_with_the_whole_global_batch(tmp_path):
    """`fstrain train --backend shm` over 2 "nodes" x 2 ranks (hierarchical all-to-all, prioritized
    pipeline: its background group is hierarchical too) trains like 1 rank with the global batch."""
    from tests.fstrain.multiproc import run_ranks
    from tests.fstrain.shards import write_shards

    one = write_shards(str(tmp_path / "r1"), num_ranks=1, num_steps=4, batch_size_per_rank=12, seed=5)
    four = write_shards(str(tmp_path / "r4"), num_ranks=4, num_steps=4, batch_size_per_rank=3, seed=5)
    [(ref, _)] = run_ranks(_train_worker, 1, one, "gloo", None)
    results = run_ranks(_train_worker, 4, four, "shm", "prioritized")
    table = [k for k in ref if "item_table" in k and "weight" in k]
    assert len(table) == 1
    for k in ref:
        if k in table:
            got = torch.cat([state[k] for state, _ in results])
            torch.testing.assert_close(got, ref[k], atol=1e-5, rtol=1e-5)
        else:
            for state, _ in results:
                torch.testing.assert_close(state[k], ref[k], atol=1e-5, rtol=1e-5, msg=lambda m: f"{k}: {m}")
    for _, (calls, inter_rows) in results:
        assert calls > 0 and inter_rows > 0  # torchrec's and the pipeline's all-to-alls crossed "nodes"
