"""Cost-budget batch policy: variable per-rank counts, equal per-rank cost.

For small per-rank batches with heavy-tailed lengths, one sample can cost more than a rank's fair
share of a fixed-count step, and no per-step assignment removes that bubble (BACKGROUND.md: 27-67%
at 4-8 samples per rank). This policy instead gives every rank of every step a *cost budget*: each
rank takes a variable number of samples whose total predicted cost fits the budget, so steps carry
equal cost rather than equal counts (the token-budget batching of e.g. fairseq's
``max_tokens`` and verl's dynamic batch size, applied per rank with a balanced fill).

Assignment (one pass over the global shuffled order, with a bounded look-ahead):

* Candidates are taken oldest first: samples skipped in earlier steps (pending), then the next
  samples of the shuffled stream. Each goes to the least loaded rank of the current step (worst
  fit) if it fits the budget there, otherwise it waits in the pending queue for the next step.
  Nothing is sorted by length, so steps stay randomly mixed; a skipped sample is the first
  candidate of the next step, so it waits at most a step or two.
* A step closes when its least loaded rank cannot take even the cheapest sample of the input, or
  when ``lookahead`` candidates of this step were skipped.
* Every rank gets at least one sample per step: while a rank is empty it is the least loaded, and
  an empty rank accepts any sample (the budget is never below the largest cost; a sample above a
  user-given budget is placed alone on an empty rank).
* When the stream runs out, a last step that cannot be closed as above and whose least loaded rank
  stays under ``tail_fill * budget`` is undone: its samples and the still-pending ones are the tail
  remainder, returned as ``step = rank = -1``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from fsdata.errors import ConfigError


@njit(cache=True)
def _argmin(loads):
    best = 0
    for r in range(1, loads.shape[0]):
        if loads[r] < loads[best]:
            best = r
    return best


@njit(cache=True)
def _plan_kernel(costs, R, budget, lookahead, cmin, tail_fill, step, rank):
    N = costs.shape[0]
    pend = np.empty(N, dtype=np.int64)
    newpend = np.empty(N, dtype=np.int64)
    placed = np.empty(N, dtype=np.int64)
    loads = np.zeros(R)
    cnt = np.zeros(R, dtype=np.int64)
    npend = 0
    nxt = 0
    s = 0
    while npend > 0 or nxt < N:
        loads[:] = 0.0
        cnt[:] = 0
        nempty = R
        amin = 0
        nplaced = 0
        nskip_old = 0
        nskip_new = 0
        nskip = 0
        q = 0
        exhausted = False
        while True:
            if q < npend:
                i = pend[q]
                q += 1
                old = True
            elif nxt < N:
                i = nxt
                nxt += 1
                old = False
            else:
                exhausted = True
                break
            ci = costs[i]
            if loads[amin] + ci <= budget or cnt[amin] == 0:
                step[i] = s
                rank[i] = amin
                loads[amin] += ci
                if cnt[amin] == 0:
                    nempty -= 1
                cnt[amin] += 1
                placed[nplaced] = i
                nplaced += 1
                amin = _argmin(loads)
            else:
                # skipped: keep arrival order (old pending first, then stream samples)
                if old:
                    newpend[nskip_old] = i
                    nskip_old += 1
                else:
                    pend[npend + nskip_new] = i  # stream samples are appended after the old queue
                    nskip_new += 1
                nskip += 1
            if nempty == 0 and (budget - loads[amin] < cmin or nskip >= lookahead):
                break
        if exhausted and (nempty > 0 or (budget - loads[amin] >= cmin and loads[amin] < tail_fill * budget)):
            for k in range(nplaced):  # the tail cannot close a step: undo it
                step[placed[k]] = -1
                rank[placed[k]] = -1
            break
        # new queue: skipped old, unscanned old, skipped new (arrival order)
        m = nskip_old
        for k in range(q, npend):
            newpend[m] = pend[k]
            m += 1
        for k in range(nskip_new):
            newpend[m] = pend[npend + k]
            m += 1
        pend, newpend = newpend, pend
        npend = m
        s += 1
    return s


def default_budget(costs: np.ndarray, batch_size_per_rank: int) -> float:
    """Default per-rank per-step budget: ``max(B * mean cost, largest cost)``.

    Ranks fill up to nearly the budget, so the mean count per rank per step is about B unless the
    largest sample alone exceeds B average samples (then it is larger, and no step has a rank that
    a single sample overflows).

    Args:
        costs: shape ``[N]``, float.
        batch_size_per_rank: B, the nominal per-rank batch.

    Returns:
        The budget, in cost units.
    """
    c = np.asarray(costs, dtype=np.float64)
    return float(max(batch_size_per_rank * c.mean(), c.max())) if c.size else 0.0


def plan_cost_budget(costs: np.ndarray, num_ranks: int, batch_size_per_rank: int,
                     budget: float | None = None, *, lookahead: int | None = None,
                     tail_fill: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """Assign samples to (step, rank) so every rank of a step carries about the same cost.

    Args:
        costs: shape ``[N]``, float64; predicted cost of each sample, in the global shuffled order.
        num_ranks: R.
        batch_size_per_rank: B, the nominal per-rank batch (sets the default budget).
        budget: per-rank per-step cost budget (same unit as ``costs``); default
            :func:`default_budget`. A sample costlier than the budget is placed alone.
        lookahead: skipped candidates after which a step closes (default ``R * max(B, 64)``,
            chosen on the shared datasets: it fills ranks tightly when samples are large relative
            to the budget); smaller keeps the order closer to the shuffle.
        tail_fill: once the input is used up, a step that cannot be filled is kept only if its
            least loaded rank reaches ``tail_fill * budget``; otherwise it and the samples still
            waiting are the dropped tail remainder.

    Returns:
        ``(step, rank)``, each shape ``[N]``, int32. Steps are numbered ``0 .. S-1``, every rank
        has at least one sample in every step, and per-rank step cost is at most ``budget``
        except for a single oversize sample. Samples of the tail remainder that cannot form a
        full step have ``step = rank = -1``.

    Raises:
        ConfigError: non-positive ``num_ranks``, ``batch_size_per_rank``, ``budget`` or
            ``lookahead``, negative or non-finite costs, fewer samples than ranks, or an input
            too small to fill a single step.
    """
    c = np.ascontiguousarray(costs, dtype=np.float64)
    if num_ranks < 1 or batch_size_per_rank < 1:
        raise ConfigError(f"num_ranks={num_ranks} and batch_size_per_rank={batch_size_per_rank} must be >= 1")
    if c.ndim != 1 or (c.size and (not np.isfinite(c).all() or c.min() < 0)):
        raise ConfigError("costs must be a 1-D array of finite, non-negative numbers; check the cost model")
    if c.size < num_ranks:
        raise ConfigError(f"cost-budget with num_ranks={num_ranks} needs at least {num_ranks} samples; "
                          f"the input has {c.size}")
    if budget is None:
        budget = default_budget(c, batch_size_per_rank)
    if not budget > 0:
        raise ConfigError(f"budget={budget} must be > 0 (default: max(B * mean cost, largest cost))")
    if lookahead is None:
        lookahead = num_ranks * max(batch_size_per_rank, 64)
    if lookahead < 1 or not 0 <= tail_fill <= 1:
        raise ConfigError(f"lookahead={lookahead} must be >= 1 and tail_fill={tail_fill} in [0, 1]")
    step = np.full(c.size, -1, dtype=np.int32)
    rank = np.full(c.size, -1, dtype=np.int32)
    cmin = max(float(c.min()), 1e-12 * float(budget))
    num_steps = _plan_kernel(c, int(num_ranks), float(budget), int(lookahead), cmin, float(tail_fill), step, rank)
    if num_steps == 0:
        raise ConfigError(f"cost-budget: {c.size} samples (total cost {c.sum():.4g}) cannot fill one step of "
                          f"{num_ranks} ranks with budget {budget:.4g} each (the budget is at least the largest "
                          "sample); use fewer ranks or more data")
    return step, rank


def step_rank_loads(costs: np.ndarray, step: np.ndarray, rank: np.ndarray, num_ranks: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Per-rank cost and sample count of every step of a (step, rank) plan.

    Args:
        costs: shape ``[N]``, float.
        step: shape ``[N]``, int; -1 for dropped samples (ignored).
        rank: shape ``[N]``, int.
        num_ranks: R.

    Returns:
        ``(loads float64[S x R], counts int64[S x R])`` with ``S = step.max() + 1``; feed
        ``loads`` to :func:`fsdata.balancer.bubble.run_bubble`.
    """
    keep = step >= 0
    S = int(step.max()) + 1 if keep.any() else 0
    flat = step[keep].astype(np.int64) * num_ranks + rank[keep]
    loads = np.bincount(flat, weights=np.asarray(costs, dtype=np.float64)[keep], minlength=S * num_ranks)
    counts = np.bincount(flat, minlength=S * num_ranks)
    return loads.reshape(S, num_ranks), counts.reshape(S, num_ranks)
