"""The prioritized pipeline's fused messages (fstrain.pipelines.exchange), on ranks simulated by threads.

Each simulated rank runs in its own thread and exchanges through an in-memory all-to-all with the
semantics of ``dist.all_to_all_single`` (sizes checked on both sides), so jagged inputs, empty
batches and the overflow round are tested without processes.
"""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

from fstrain.pipelines.exchange import IdExchange, pack_replies, segment_counts, unpack_replies


class _Group:
    """An in-memory all-to-all between ``R`` threads; counts its calls."""

    def __init__(self, world_size: int) -> None:
        self.R = world_size
        self.barrier = threading.Barrier(world_size, timeout=20)
        self.box: dict[int, tuple] = {}
        self.calls = [0] * world_size

    def a2a(self, rank: int):
        def call(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
            assert sum(send) == x.shape[0]
            self.box[rank] = (torch.split(x, send), recv)
            self.barrier.wait()
            parts = [self.box[r][0][rank] for r in range(self.R)]
            assert [p.shape[0] for p in parts] == recv, "receive sizes differ from what the senders sent"
            out = torch.cat(parts)
            self.barrier.wait()
            self.calls[rank] += 1
            return out
        return call


def _run(world_size: int, fn):
    group = _Group(world_size)
    with concurrent.futures.ThreadPoolExecutor(world_size) as pool:
        return [f.result() for f in [pool.submit(fn, r, group.a2a(r)) for r in range(world_size)]], group


BOUNDS = [0, 10, 20, 30]  # rank r owns rows [BOUNDS[r], BOUNDS[r + 1])


def _owner(ids: torch.Tensor) -> torch.Tensor:
    return torch.bucketize(ids, torch.tensor(BOUNDS[1:-1]), right=True)


@pytest.mark.parametrize("batches", [
    # per step, per rank: sorted unique ids (jagged; empty batches on a rank and on all ranks)
    [[[1, 2, 11, 25], [3], [12, 13, 14, 15, 16, 17, 28]],
     [[], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 29], [4]],
     [[], [], []],
     [[5], [15], [25]]],
])
def test_id_exchange_delivers_ids_and_gradients_with_one_call_per_step_once_capacity_holds(batches):
    R, d = 3, 4

    def rank_fn(rank, a2a):
        ex = IdExchange(R)
        got, calls = [], []
        for step, per_rank in enumerate(batches):
            ids = torch.tensor(per_rank[rank], dtype=torch.int64)
            # gradient rows: rank sends step*100 + rank*10 + j to every peer j, (j + 1) rows each
            send_g = [(j + 1) * (step > 0) for j in range(R)]
            recv_g = [(rank + 1) * (step > 0)] * R
            grad = torch.cat([torch.full((n, d), float(step * 100 + rank * 10 + j)) for j, n in enumerate(send_g)])
            before = ex.num_overflows
            send, recv, recv_ids, recv_grad = ex.exchange(a2a, ids, _owner(ids), grad, send_g, recv_g)
            got.append((send, recv, recv_ids.tolist(), recv_grad))
            calls.append(ex.num_overflows > before)
        return got, calls, ex.capacity

    results, group = _run(R, rank_fn)
    for rank, (got, overflows, capacity) in enumerate(results):
        for step, (send, recv, recv_ids, recv_grad) in enumerate(got):
            per_rank = batches[step]
            mine = [i for r in range(R) for i in per_rank[r] if BOUNDS[rank] <= i < BOUNDS[rank + 1]]
            assert recv_ids == mine  # grouped by sender, in the sender's order
            assert recv == [sum(BOUNDS[rank] <= i < BOUNDS[rank + 1] for i in per_rank[r]) for r in range(R)]
            assert send == [sum(BOUNDS[j] <= i < BOUNDS[j + 1] for i in per_rank[rank]) for j in range(R)]
            want = [float(step * 100 + r * 10 + rank) for r in range(R) for _ in range((rank + 1) * (step > 0))]
            assert recv_grad.shape == (len(want), d) and recv_grad[:, 0].tolist() == want
        assert overflows == [True, True, False, False]  # capacity 0, then ceil(1.25 * 6) = 8 < 10 ids, then it holds
        assert capacity == 13  # ceil(1.25 * 10)
    assert group.calls == [6] * R  # 4 exchanges + 2 overflow rounds


def test_replies_carry_flags_and_rows_in_one_call():
    R, d = 2, 3
    sent = [[2, 1], [0, 3]]  # ids rank r sent to owner j
    prev_sent = [[1, 0], [2, 2]]

    def rank_fn(rank, a2a):
        recv = [sent[r][rank] for r in range(R)]
        keep_recv = [prev_sent[r][rank] for r in range(R)]
        m = sum(recv)
        rows = torch.arange(m * d, dtype=torch.float32).view(m, d) + 1000 * rank
        recv_ol = torch.arange(m) % 2 == 0
        keep = torch.arange(sum(keep_recv)) % 3 == 0
        buf, sizes = pack_replies(recv_ol, recv, keep, keep_recv, rows)
        ol, kp, got_rows = unpack_replies(a2a, buf, sizes, sent[rank], prev_sent[rank], d)
        return (recv_ol, keep, rows, recv, keep_recv), (ol, kp, got_rows)

    results, group = _run(R, rank_fn)
    assert group.calls == [1, 1]
    for rank in range(R):
        ol, kp, got_rows = results[rank][1]
        want_ol, want_keep, want_rows = [], [], []
        for owner in range(R):
            recv_ol, keep, rows, recv, keep_recv = results[owner][0]
            start, kstart = sum(recv[:rank]), sum(keep_recv[:rank])
            want_ol += recv_ol[start:start + recv[rank]].tolist()
            want_keep += keep[kstart:kstart + keep_recv[rank]].tolist()
            want_rows.append(rows[start:start + recv[rank]])
        assert ol.tolist() == want_ol and kp.tolist() == want_keep
        assert torch.equal(got_rows, torch.cat(want_rows))


def test_replies_without_a_previous_batch():
    def rank_fn(rank, a2a):
        rows = torch.ones(1, 2)
        buf, sizes = pack_replies(torch.tensor([True]), [1 - rank, rank], None, None, rows[:1])
        return unpack_replies(a2a, buf, sizes, [1 - rank, rank], None, 2)

    results, _ = _run(2, rank_fn)
    for ol, keep, rows in results:
        assert keep is None and ol.tolist() == [True] and rows.shape == (1, 2)


def test_segment_counts():
    assert segment_counts(torch.tensor([True, False, True, True]), [1, 3]) == [1, 2]
    assert segment_counts(torch.zeros(0, dtype=torch.bool), [0, 0]) == [0, 0]
