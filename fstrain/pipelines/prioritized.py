"""Prioritized embedding communication on any backend (CPU/gloo included): our own PEC schedule.

The idea (FreeScale, MLSys 2026; torchrec's ``TrainPipelinePEC``): of the item-table rows batch
N+1 needs, those that batch N does not touch (NOL, "non-overlapping") already hold their final
values for step N+1 once step N-1's update is applied, so their lookup and all-to-all can run
one step early, hidden behind batch N's dense compute. Only the rows both batches touch (OL) must
wait for step N's update. Each row's gradient is applied exactly once per step, as in plain
training, so the parameters equal the non-pipelined run (``tests/fstrain/test_pipeline.py``).

Mechanism (implemented here, not torchrec's code): a rank deduplicates the ids of its batch
(``torch.unique``; sorted ids are already grouped by owner under row-wise sharding), sends them
to the owning ranks, and the owner classifies each requested row against the set of rows
requested from it by *all* ranks in the previous batch (a boolean row mask). Everything on the
way runs on one background thread over a second gloo/NCCL process group, so its collectives
never interleave with the main thread's, in two all-to-alls (:mod:`fstrain.pipelines.exchange`):
counts, ids and the held gradient of the step before last in one fixed-capacity message; then,
after classification, the held update and the lookup, the OL flags of this batch, the keep flags
of the previous one and the rows read ahead in another. After the update of batch N the main
thread fetches the OL rows of batch N+1 (one all-to-all) and runs the dense step. Gradients are
re-split: rows that batch N+2 also touches are sent to their owners at once and applied through
the table's fused optimizer (a re-lookup whose backward runs fbgemm's fused update, one all-to-all);
the others are held and travel with the next prefetch's ids, which applies them before it reads
anything. Then the dense all-reduce and step: four all-to-alls per step in all (one more when
the id capacity overflows). Rows are read by a gather from the table's weights; the TBE runs only
for the two fused updates. Inline (``overlap=False``) the lookup of N+1 follows N's backward, so
N's whole gradient travels with N+1's ids: two all-to-alls per step, as many as torchrec's
sparse-dist pipeline exposes (rows out, gradients back).

Notation: ``U`` unique ids of this rank's batch, ``d`` embedding dim, ``R`` world size,
``M`` ids requested from this rank by all ranks (with repeats across ranks).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from fstrain.data.batch import HISTORY_KEY, TARGET_KEY, Batch
from fstrain.distributed.sharding import aliased_shard, dense_parameters
from fstrain.models.config import NEGATIVE_KEY
from fstrain.models.recommender import objective_inputs
from fstrain.pipelines.base import PIPELINES, PipelineConfig, PipelineError, TrainPipeline
from fstrain.pipelines.exchange import IdExchange, pack_replies, segment_counts as _segment_counts, unpack_replies
from fstrain.pipelines.ordering import CollectiveOrderGate, needs_ordered_collectives


@dataclass(slots=True)
class _Exchange:
    """One batch's row exchange, as prepared by the background thread.

    Requester side (this rank's batch): ``ids [U]`` sorted unique ids, ``inverse [n]`` position
    of each KJT value in ``ids``, ``send_counts [R]`` ids sent to each owner, ``ol_mask [U]``
    rows to fetch after the update, ``rows [U x d]`` every row as read ahead (the NOL rows are
    final; the OL ones are replaced by the fetch after the update).
    Owner side (requests of all ranks to this rank): ``recv_counts [R]``, ``recv_local [M]``
    local row indices, ``recv_ol [M]`` the OL flags.
    About the *previous* batch (``None`` for a batch without one): ``prev_keep [U_prev]`` its
    rows that this batch also touches (their gradient is applied in the previous step, before
    this batch's OL fetch; the others are deferred), ``prev_recv_keep [M_prev]`` the owner's view.
    ``seconds``: the job's time; ``parts``: seconds of its steps (ids exchange, held update,
    lookup, replies exchange).
    """

    batch: Batch
    ids: torch.Tensor
    inverse: torch.Tensor
    send_counts: list[int]
    ol_mask: torch.Tensor
    rows: torch.Tensor
    recv_counts: list[int]
    recv_local: torch.Tensor
    recv_ol: torch.Tensor
    prev_keep: torch.Tensor | None
    prev_recv_keep: torch.Tensor | None
    seconds: float
    parts: dict[str, float]


@PIPELINES.register("prioritized")
class PrioritizedPipeline(TrainPipeline):
    """Prioritized embedding communication with exact synchronous semantics.

    Threads and process groups:

    * background thread, second process group, one job at a time in submission order:
      ``## prefetch_nol ##`` for batch N+1 while batch N computes: one all-to-all of counts, ids
      and the held gradient of batch N-1 (the rows N does not touch), their fused update, the
      OL/NOL split on the owner and the keep flags of batch N's rows that N+1 touches, the
      lookup, one all-to-all of flags and rows. ``## deferred_sparse_update ##`` only at
      :meth:`flush` (the held gradient without a next prefetch: one all-to-all).
    * main thread, default process group: ``## fetch_ol ##`` (OL lookup + all-to-all, after
      N-1's update), ``## dense_forward_backward ##`` (with the straggler barrier on a third
      group), ``## dense_allreduce ##`` (started asynchronously), ``## wait_prefetch ##`` (the
      job of N+1 must be done before the table is written), ``## sparse_update ##`` (rows N+1
      touches), ``## optimizer ##``.

    Issue order (NCCL, ``fs_cuda_ce``; :mod:`fstrain.pipelines.ordering`): two NCCL communicators
    driven from two threads must see their operations issued in the same order on every rank
    (NCCL User Guide, "Using multiple NCCL communicators concurrently"). The gate makes each
    background job issue all its collectives between its submission and the main thread's next
    collective: per step ``fetch_ol`` (main) -> the prefetch of N+1 (background: 2 all-to-alls,
    3 on an id overflow) -> straggler all-reduce, dense all-reduce, sparse update (main); the
    last step then flushes (background). On gloo / ``fs_shm`` the gate is off by default.

    CUDA: the background jobs run on a side stream that waits for an event recorded on the main
    stream at submission; the main stream waits for the side stream before it uses their
    results. Written for GPUs but not run on one (no figures).

    Args:
        dmp: the sharded model (one row-wise table shared by history, target and negatives).
        optimizer: its optimizer (fused sparse + dense Adam).
        device: where the model runs.
        overlap: run the NOL exchange on the background thread (``False``: inline on the main
            thread, two all-to-alls per step, :meth:`_progress_inline`; the same results).
        ordered_collectives: issue the two threads' collectives in one order, the same on every
            rank (:class:`fstrain.pipelines.ordering.CollectiveOrderGate`); ``None`` (default): on
            where the backend needs it (NCCL, ``fs_cuda_ce``: two NCCL communicators driven from
            two threads), off on gloo / ``fs_shm``. Results are the same either way.

    Raises:
        PipelineError: the table is not row-wise sharded in a single group.
    """

    name = "prioritized"

    @classmethod
    def from_config(cls, config: PipelineConfig, dmp, optimizer, device) -> PrioritizedPipeline:
        """Build it with ``overlap`` and ``ordered_collectives`` from ``config`` too (collective)."""
        return cls(dmp, optimizer, device, overlap=config.overlap, ordered_collectives=config.ordered_collectives,
                   measure_straggler_wait=config.measure_straggler_wait)

    def __init__(self, dmp, optimizer, device, *, overlap: bool = True, ordered_collectives: bool | None = None,
                 **kwargs) -> None:
        super().__init__(dmp, optimizer, device, **kwargs)
        self.overlap = overlap
        if ordered_collectives is None:
            ordered_collectives = needs_ordered_collectives(dist.get_backend())
        #: the order of the main thread's and the background thread's collectives (NCCL: one order on every rank)
        self.gate = CollectiveOrderGate(enabled=ordered_collectives and overlap)
        self.timer.before_collective = self.gate.before_collective  # the straggler all-reduce
        ec = dmp.module.ec
        ec = getattr(ec, "_embedding_collection", ec)  # a PEC-wrapped table: use the inner collection
        shardings = getattr(ec, "_sharding_type_to_sharding", {})
        if list(shardings) != ["row_wise"] or len(ec._lookups) != 1:
            raise PipelineError(f"the prioritized pipeline needs one row-wise sharded table group; this model has "
                                f"sharding types {list(shardings)}; "
                                "build it with fstrain.distributed.sharding.build_sharded_model")
        self._lookup = ec._lookups[0]  # GroupedEmbeddingsLookup over this rank's rows (fused TBE)
        self._feature_names = list(shardings["row_wise"].feature_names())
        (table_name, weight), = [(k, v) for k, v in ec.state_dict().items() if k.endswith(".weight")]
        metas = sorted(weight.metadata().shards_metadata, key=lambda m: m.shard_offsets[0])
        self.row_offsets = [m.shard_offsets[0] for m in metas] + [metas[-1].shard_offsets[0] + metas[-1].shard_sizes[0]]
        self.embedding_dim = int(weight.size(1))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        owners = [m.placement.rank() for m in metas]
        if owners != list(range(self.world_size)):
            raise PipelineError(f"{table_name}: row shards are placed on ranks {owners}; the prioritized pipeline "
                                f"expects shard r on rank r (ROW_WISE over all {self.world_size} ranks)")
        self._boundaries = torch.tensor(self.row_offsets[1:-1], dtype=torch.int64)
        #: (this rank's rows, the TBE tensor they alias, its storage address), read without the TBE; or None
        self._weight = aliased_shard(weight, self._lookup)
        self._my_offset = self.row_offsets[self.rank]
        self._touched = torch.zeros(self.row_offsets[self.rank + 1] - self._my_offset, dtype=torch.bool)
        self._group = dist.new_group(backend=dist.get_backend())  # collective: every rank, same order
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fstrain-prefetch")
        self._pending: concurrent.futures.Future | None = None
        #: ids (+ held gradient) to their owners: one all-to-all with a fixed, shared capacity per peer
        self._ids = IdExchange(self.world_size)
        #: the previous step's gradient of rows the next batch does not touch: ``(grad, send, recv, local)``,
        #: sent with the next prefetch's ids (or by :meth:`flush`)
        self._held: tuple[torch.Tensor, list[int], list[int], torch.Tensor] | None = None
        # table accesses from the two threads touch disjoint rows; the lock keeps the fused
        # kernels themselves from running concurrently (never held across a collective)
        self._tbe_lock = threading.Lock()
        # CUDA: the background job's kernels go to a side stream (its collectives to the second
        # process group's own NCCL stream), ordered after the main stream at submission.
        self._side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # ------------------------------------------------------------------ helpers
    def _rows(self, local: torch.Tensor) -> KeyedJaggedTensor:
        """KJT for the lookup: ``local`` row ids under the first feature, the others empty."""
        n = len(self._feature_names)
        lengths = torch.zeros(n, dtype=torch.int64)
        lengths[0] = local.numel()
        return KeyedJaggedTensor(keys=self._feature_names, values=local.to(self.device),
                                 lengths=lengths.to(self.device), stride=1)

    def _lookup_rows(self, local: torch.Tensor) -> torch.Tensor:
        """Current values of this rank's rows ``local [k]`` -> ``[k x d]`` (no gradient).

        A gather from the table's own weights where the local shard is a view of them (fbgemm's
        TBE: no kernel launch, no KJT; the same values); else a lookup through the TBE.
        """
        if local.numel() == 0:
            return torch.zeros(0, self.embedding_dim, device=self.device)
        with self._tbe_lock, torch.no_grad():
            if self._weight is not None and self._weight[1].untyped_storage().data_ptr() == self._weight[2]:
                return self._weight[0].index_select(0, local.to(self._weight[0].device))
            return self._lookup(self._rows(local)).view(-1, self.embedding_dim)

    def _all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int], group=None) -> torch.Tensor:
        """Uneven all-to-all of the rows of ``x`` (``send[r]`` rows to rank r, ``recv[r]`` from r).

        ``group=None`` is the default group, used by the main thread only: it passes the gate first.
        """
        if group is None:
            self.gate.before_collective()
        out = torch.empty((sum(recv),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    # ------------------------------------------------------------- background job
    def _prefetch(self, batch: Batch, prev: _Exchange | None, held, ready: torch.cuda.Event | None) -> _Exchange:
        """Background thread: exchange ids of ``batch`` and fetch its NOL rows (see the class doc),
        applying first the ``held`` gradient of the step before ``prev`` (sent with the ids).

        ``ready`` (CUDA): recorded on the main stream at submission; the side stream waits on it
        so the lookup reads the table after the previous update.
        """
        t0 = time.perf_counter()
        with self._on_side_stream(ready):
            return self._prefetch_on_stream(batch, prev, held, t0)

    def _on_side_stream(self, ready: torch.cuda.Event | None):
        """CUDA: run on the side stream after ``ready``; CPU: nothing."""
        if self._side_stream is None:
            return contextlib.nullcontext()
        self._side_stream.wait_event(ready)
        return torch.cuda.stream(self._side_stream)

    def _prefetch_on_stream(self, batch: Batch, prev: _Exchange | None, held, t0: float) -> _Exchange:
        parts, tick = {}, [time.perf_counter()]

        def lap(name: str) -> None:
            now = time.perf_counter()
            parts[f"background_prefetch.{name}"] = now - tick[0]
            tick[0] = now

        with torch.no_grad(), record_function("## prefetch_nol ##"):
            a2a = functools.partial(self._all_to_all, group=self._group)
            ids, inverse = torch.unique(batch.features.values(), sorted=True, return_inverse=True)
            owner = torch.bucketize(ids.cpu(), self._boundaries, right=True)
            if held is None:
                zeros = [0] * self.world_size
                held = (torch.zeros(0, self.embedding_dim, device=self.device), zeros, zeros, None)
            grad, grad_send, grad_recv, grad_local = held
            # one all-to-all: counts (headers), ids, and the held gradient of the step before last
            send, recv, recv_ids, recv_grad = self._ids.exchange(a2a, ids, owner, grad, grad_send, grad_recv)
            lap("ids")
            if grad_local is not None:  # those rows' update, before anything below reads them
                self._update_rows(grad_local, recv_grad)
            lap("held_update")
            recv_local = recv_ids.cpu() - self._my_offset
            if prev is None:
                recv_ol = torch.zeros(recv_local.numel(), dtype=torch.bool)
            else:
                recv_ol = self._touched[recv_local]  # rows the previous batch (any rank) updates
            self._touched.zero_()
            self._touched[recv_local] = True
            rows = self._lookup_rows(recv_local)  # all requested rows; the OL ones are re-read after the update
            lap("lookup")
            prev_recv_keep = None if prev is None else self._touched[prev.recv_local]  # backward split of prev
            prev_recv, prev_send = (None, None) if prev is None else (prev.recv_counts, prev.send_counts)
            buf, sizes = pack_replies(recv_ol, recv, prev_recv_keep, prev_recv, rows)
            # one all-to-all: this batch's OL flags, the previous batch's keep flags, the rows
            ol_mask, prev_keep, rows = unpack_replies(a2a, buf, sizes, send, prev_send, self.embedding_dim)
            lap("replies")
        return _Exchange(batch, ids, inverse.to(self.device), send, ol_mask, rows, recv, recv_local, recv_ol,
                         prev_keep, prev_recv_keep, time.perf_counter() - t0, parts)

    def _ready_event(self) -> torch.cuda.Event | None:
        """CUDA: an event on the main stream after everything issued so far; CPU: ``None``."""
        if self._side_stream is None:
            return None
        ready = torch.cuda.Event()
        ready.record()
        return ready

    def _to_side(self, *tensors) -> None:
        """CUDA: mark main-stream tensors as used by the side stream, so the caching allocator does
        not reuse their memory while a background job may still read them."""
        if self._side_stream is None:
            return
        for t in tensors:
            if isinstance(t, Batch) or (isinstance(t, torch.Tensor) and t.is_cuda):
                t.record_stream(self._side_stream)

    def _submit(self, batch: Batch, prev: _Exchange | None) -> None:
        self._to_side(batch)  # copied to the device on the main stream, read by the background job
        held, self._held = self._held, None
        self._pending = self.gate.submit(self._pool, self._prefetch, batch, prev, held, self._ready_event())

    def _apply_held(self, held, ready: torch.cuda.Event | None) -> None:
        """Send the held gradient to its owners (one all-to-all, background group) and apply it."""
        with self._on_side_stream(ready), record_function("## deferred_sparse_update ##"):
            grad, send, recv, local = held
            self._apply_grad(grad, send, recv, local, group=self._group)

    def flush(self) -> None:
        """Apply the last step's held gradient now (call before a checkpoint; collective: every rank).

        A step keeps the gradient of rows the next batch does not touch and sends it with the next
        prefetch's ids; until then the table lacks it. Without a held gradient this does nothing.
        """
        held, self._held = self._held, None
        if held is None:
            return
        t0 = time.perf_counter()
        if self.overlap:  # the background group belongs to the background thread
            self.gate.submit(self._pool, self._apply_held, held, self._ready_event()).result()
        else:
            self._apply_held(held, self._ready_event())
        if self._side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
        self._phases["flush_deferred_update"] = time.perf_counter() - t0

    def _wait(self) -> _Exchange:
        with self._phase("wait_prefetch"):
            ex = self._pending.result()
            if self._side_stream is not None:  # the job's kernels were issued, not necessarily done
                main = torch.cuda.current_stream(self.device)
                main.wait_stream(self._side_stream)
                for t in (ex.rows, ex.inverse, ex.ids):  # made on the side stream, used on the main one
                    if t.is_cuda:
                        t.record_stream(main)
        self._pending = None
        return ex

    # --------------------------------------------------------------- main thread
    def _fetch_ol(self, ex: _Exchange) -> torch.Tensor:
        """OL rows (after the previous update) written over their early reads: ``[U x d]``."""
        with self._phase("fetch_ol"):
            ol_rows_out = self._lookup_rows(ex.recv_local[ex.recv_ol])
            ol_rows = self._all_to_all(ol_rows_out, _segment_counts(ex.recv_ol, ex.recv_counts),
                                       _segment_counts(ex.ol_mask, ex.send_counts))
            emb = ex.rows
            emb[ex.ol_mask.to(self.device)] = ol_rows
        return emb

    def _apply_grad(self, grad: torch.Tensor, send: list[int], recv: list[int], local: torch.Tensor,
                    group=None) -> None:
        """Send row gradients ``grad [sum(send) x d]`` to their owners; the owner applies the received
        ``[sum(recv) x d]`` to its rows ``local`` in one fused update (a re-lookup whose backward runs
        the table's fused optimizer; fbgemm sums repeated rows first)."""
        self._update_rows(local, self._all_to_all(grad, send, recv, group))

    def _update_rows(self, local: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply ``grad [k x d]`` to this rank's rows ``local [k]``: one fused update (re-lookup + backward)."""
        if local.numel():
            with self._tbe_lock, torch.enable_grad():
                out = self._lookup(self._rows(local)).view(-1, self.embedding_dim)
                out.backward(grad)

    def _sparse_update(self, ex: _Exchange, grad: torch.Tensor, nxt: _Exchange | None) -> None:
        """Apply now the gradient of rows the next batch touches; hold the rest for the next prefetch.

        Every row still gets its whole step gradient in one update, before anything reads it again:
        rows the next batch touches before its OL fetch, the others at the start of the next
        prefetch (of the batch after next), which sends them with its ids (or at :meth:`flush`).
        """
        with self._phase("sparse_update"):
            if nxt is None:  # last batch: nothing to defer
                self._apply_grad(grad, ex.send_counts, ex.recv_counts, ex.recv_local)
                return
            keep, recv_keep = nxt.prev_keep, nxt.prev_recv_keep
            assert keep is not None and recv_keep is not None  # nxt was prefetched with ex as its previous batch
            self._apply_grad(grad[keep.to(grad.device)], _segment_counts(keep, ex.send_counts),
                             _segment_counts(recv_keep, ex.recv_counts), ex.recv_local[recv_keep])
            held = (grad[~keep.to(grad.device)], _segment_counts(~keep, ex.send_counts),
                    _segment_counts(~recv_keep, ex.recv_counts), ex.recv_local[~recv_keep])
        self._to_side(held[0])  # a gradient slice made on the main stream, sent by the background job
        self._held = held

    def _start_dense_allreduce(self):
        """Start the SUM all-reduce of the dense gradients (one flat buffer, asynchronous)."""
        params = [p for p in dense_parameters(self.dmp) if p.grad is not None]
        if self.world_size == 1 or not params:
            return None
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.gate.before_collective()
        return dist.all_reduce(flat, async_op=True), flat, params

    @staticmethod
    def _finish_dense_allreduce(pending) -> None:
        if pending is None:
            return
        work, flat, params = pending
        work.wait()
        off = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[off:off + n].view_as(p.grad))
            off += n

    def _dense_step(self, ex: _Exchange, emb: torch.Tensor):
        """Forward + backward of the dense model on the rows ``emb [U x d]``: ``(output, row gradient [U x d])``."""
        batch, f = ex.batch, ex.batch.features
        self._mark(batch)
        with record_function("## dense_forward_backward ##"):
            leaf = emb.requires_grad_()
            pos = dict(zip(f.keys(), torch.split(ex.inverse, f.length_per_key())))
            loss, output = self.dmp.module.dense(
                leaf[pos[HISTORY_KEY]], f[HISTORY_KEY].lengths(), leaf[pos[TARGET_KEY]], leaf[pos[NEGATIVE_KEY]],
                batch.target_ids, f[NEGATIVE_KEY].values(), batch.global_num_samples, **objective_inputs(batch))
            loss.backward()
        return output, leaf.grad

    def _optimizer_step(self, pending_allreduce) -> None:
        with self._phase("dense_allreduce"):
            self._finish_dense_allreduce(pending_allreduce)
        with record_function("## optimizer ##"):
            self.timed_optimizer.step()
            self.optimizer.zero_grad()

    def _progress_inline(self, dataloader_iter):
        """``overlap=False``: two all-to-alls per step on the main thread. Batch N+1's rows are read
        after N's backward, so N's whole row gradient travels with N+1's ids and the owners apply it
        before they read (every row final: no OL fetch, no gradient all-to-all) while N's dense
        all-reduce runs. After a step the table is complete (the last batch's gradient too)."""
        if self._pending is None:  # the first batch (or the first after a flush): nothing held
            self.flush()
            batch = next(dataloader_iter).to(self.device)
            self._to_side(batch)
            with self._phase("prefetch_inline"):
                self._pending = _done(self._prefetch(batch, None, None, self._ready_event()))
        ex = self._wait()
        output, grad = self._dense_step(ex, ex.rows)
        with self._phase("dense_allreduce"):
            pending_allreduce = self._start_dense_allreduce()  # overlaps the exchange below
        held = (grad, ex.send_counts, ex.recv_counts, ex.recv_local)
        try:
            nxt = next(dataloader_iter).to(self.device)
        except StopIteration:
            self._held = held
            with self._phase("sparse_update"):
                self.flush()
        else:
            self._to_side(nxt, grad)
            with self._phase("prefetch_inline"):
                self._pending = _done(self._prefetch(nxt, None, held, self._ready_event()))
        self._optimizer_step(pending_allreduce)
        self._phases.update(ex.parts)
        return output, ex.ids.numel(), 0

    def _progress(self, dataloader_iter):
        if not self.overlap:
            return self._progress_inline(dataloader_iter)
        if self._pending is None:  # fill: the first batch has no predecessor, all its rows are NOL
            self.flush()
            self._submit(next(dataloader_iter).to(self.device), None)
        ex = self._wait()
        emb = self._fetch_ol(ex)
        try:
            nxt = next(dataloader_iter).to(self.device)
        except StopIteration:
            nxt = None
        if nxt is not None:
            self._submit(nxt, ex)  # NOL of N+1 overlaps everything below
        output, grad = self._dense_step(ex, emb)
        with self._phase("dense_allreduce"):
            pending_allreduce = self._start_dense_allreduce()  # overlaps the sparse update below
        nxt_ex = self._wait() if nxt is not None else None  # table writes below must not race the lookup
        self._sparse_update(ex, grad, nxt_ex)
        self._optimizer_step(pending_allreduce)
        if nxt_ex is not None:
            self._pending = _done(nxt_ex)
        else:
            self.flush()  # last batch: the held gradient of the step before, so the table is complete
        self._phases["background_prefetch"] = ex.seconds  # hidden work, not main-thread time
        self._phases.update(ex.parts)
        if self.gate.enabled:  # collectives between steps (logging, checkpoint) come after the step's jobs
            with self._phase("wait_background_issue"):
                self.gate.before_collective()
        num_ol = int(ex.ol_mask.sum())
        return output, ex.ids.numel() - num_ol, num_ol

    def close(self) -> None:
        """Apply the held gradient (:meth:`flush`, collective) and stop the background thread."""
        self.flush()
        super().close()
        self._pool.shutdown(wait=True)
        if self._group is not None:
            dist.destroy_process_group(self._group)  # local; no collective is in flight here
            self._group = None


def _done(value) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(value)
    return fut
