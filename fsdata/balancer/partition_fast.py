"""Fast per-step partitioners: numba kernels for sorted LPT + best-swap, and sorted snake.

Notation: ``S`` steps, ``R`` ranks (world size), ``B`` samples per rank per step (per-rank batch),
``N = R*B`` samples per step (the global batch). Every kernel returns, for each sample, the rank it
goes to, with exactly ``B`` samples on every rank of every step.

``lpt-swap`` (the default fast method) is two phases per step:

1. Sorted LPT respecting the per-rank count (Graham 1969, "Bounds on multiprocessing timing
   anomalies"): samples by decreasing cost, each to the least loaded rank that still has room.
   The least loaded rank comes from a tournament tree keyed on ``(load, rank)``, the order of the
   heap in :func:`fsdata.balancer.partition.lpt_reference`, so with ``max_swap_iters=0`` the per-rank loads
   equal the reference's (equal-cost samples may trade places, which changes only the float
   summation order).
2. Best-swap improvement: while it lowers the straggler, exchange one sample of the most loaded
   rank ``m`` with one sample of a lighter rank ``r``. For a gap ``g = L_m - L_r`` the best exchange
   moves ``d = c_a - c_b`` closest to ``g / 2`` (pair maximum ``max(L_m - d, L_r + d)``); each rank
   keeps its costs sorted, so the partner is found by binary search. The lightest rank is tried
   first, ranks with ``(L_m + L_r) / 2`` above the best exchange found are skipped, and the scan
   stops as soon as an exchange brings ``L_m`` down to the step's lower bound times
   ``1 + swap_tolerance`` (where the pass ends).
   Every accepted exchange strictly lowers the sorted load vector, so the pass terminates and the
   result is never worse than phase 1.

Steps are independent and run in parallel with ``numba.prange``; ``num_threads`` caps the threads.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from fsdata.errors import ConfigError

#: Default cap on improving exchanges per step. Each exchange costs about ``R*B*log2(B)`` operations
#: in the worst case; in practice the pruned scan stops after a few ranks.
DEFAULT_MAX_SWAP_ITERS = 1024

# Relative margin an exchange must beat the current straggler by (guards against float ping-pong).
_REL_EPS = 1e-12

#: Default relative distance to the step's lower bound at which the swap pass stops:
#: ``max_load <= lower_bound * (1 + tol)``; 5e-5 keeps the bubble within 0.005 percentage points.
DEFAULT_SWAP_TOLERANCE = 5e-5

# Below this many samples per step, numba's argsort beats the radix sort's fixed passes.
_RADIX_MIN_N = 1024


@njit(cache=True)
def _order_desc(c, keys, tmp, order):
    """Indices of ``c`` (costs >= 0) by decreasing cost, written to ``order``.

    LSD radix sort (11-bit digits) of 64-bit keys: the complemented IEEE-754 bits of the cost
    (order-preserving for non-negative floats) with the sample index in the low ``idx_bits`` bits,
    then one insertion pass on the exact costs to order values that differ only in the masked-out
    low mantissa bits. Radix passes whose digit is constant are skipped.
    """
    n = c.shape[0]
    if n < _RADIX_MIN_N:
        order[:] = np.argsort(-c)
        return
    idx_bits = 1
    while (1 << idx_bits) < n:
        idx_bits += 1
    idx_mask = np.uint64((1 << idx_bits) - 1)
    bits = c.view(np.uint64)
    for i in range(n):
        keys[i] = ((~bits[i]) & ~idx_mask) | np.uint64(i)
    cnt = np.empty(2049, dtype=np.int64)
    shift = idx_bits
    while shift < 64:
        cnt[:] = 0
        sh = np.uint64(shift)
        for i in range(n):
            cnt[((keys[i] >> sh) & np.uint64(2047)) + 1] += 1
        if cnt.max() < n:
            for k in range(2048):
                cnt[k + 1] += cnt[k]
            for i in range(n):
                d = (keys[i] >> sh) & np.uint64(2047)
                tmp[cnt[d]] = keys[i]
                cnt[d] += 1
            keys[:] = tmp
        shift += 11
    for i in range(n):
        order[i] = keys[i] & idx_mask
    for i in range(1, n):
        j = i
        v = order[i]
        while j > 0 and c[order[j - 1]] < c[v]:
            order[j] = order[j - 1]
            j -= 1
        order[j] = v


@njit(cache=True)
def _lpt_step(c, R, B, out, loads, member, mcost, order, keys, tmp, key, tree, counts):
    """Sorted LPT with count limit for one step; fills ``out``, ``loads``, ``member``, ``mcost``.

    The least loaded rank with room comes from a tournament tree over the ranks (``tree[1]`` is the
    winner; ties go to the lower rank, as in the reference heap); a full rank's key becomes +inf.
    ``member[r, j]`` / ``mcost[r, j]`` are rank r's samples and their costs, by decreasing cost.

    Returns:
        the step's lower bound ``max(sum / R, max + sum of the B-1 smallest)``.
    """
    n = c.shape[0]
    _order_desc(c, keys, tmp, order)
    P = tree.shape[0] // 2
    for r in range(P):
        key[r] = 0.0 if r < R else np.inf
        tree[P + r] = r
    for r in range(R):
        counts[r] = 0
        loads[r] = 0.0
    for node in range(P - 1, 0, -1):
        a = tree[2 * node]
        b = tree[2 * node + 1]
        tree[node] = b if key[b] < key[a] else a
    for k in range(n):
        i = order[k]
        r = tree[1]
        out[i] = r
        member[r, counts[r]] = i
        mcost[r, counts[r]] = c[i]
        counts[r] += 1
        loads[r] += c[i]
        key[r] = loads[r] if counts[r] < B else np.inf
        node = (P + r) >> 1
        while node >= 1:
            a = tree[2 * node]
            b = tree[2 * node + 1]
            tree[node] = b if key[b] < key[a] else a
            node >>= 1
    total = 0.0
    small = 0.0
    for k in range(n):
        total += c[k]
    for k in range(n - B + 1, n):
        small += c[order[k]]
    return max(total / R, c[order[0]] + small)


@njit(cache=True)
def _first_le(row, target):
    """First index j of a decreasing row with row[j] <= target (len(row) if none)."""
    lo = 0
    hi = row.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if row[mid] <= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


@njit(cache=True)
def _reinsert(member_row, mcost_row, j):
    """Restore decreasing order of a row after its entry j changed (single insertion move)."""
    B = mcost_row.shape[0]
    v = mcost_row[j]
    s = member_row[j]
    while j > 0 and mcost_row[j - 1] < v:
        mcost_row[j] = mcost_row[j - 1]
        member_row[j] = member_row[j - 1]
        j -= 1
    while j < B - 1 and mcost_row[j + 1] > v:
        mcost_row[j] = mcost_row[j + 1]
        member_row[j] = member_row[j + 1]
        j += 1
    mcost_row[j] = v
    member_row[j] = s


@njit(cache=True)
def _swap_pass(R, B, max_iters, stop_load, out, loads, member, mcost):
    """Best-swap improvement of the straggler; returns the number of exchanges made.

    Stops when no exchange lowers the most loaded rank, after ``max_iters`` exchanges, or once the
    most loaded rank is at most ``stop_load`` (the step's lower bound times ``1 + tolerance``).
    """
    done = 0
    for _ in range(max_iters):
        m = np.argmax(loads)
        Lm = loads[m]
        if Lm <= stop_load:
            break
        best_val = Lm - _REL_EPS * abs(Lm)
        second = stop_load
        best_r = -1
        best_a = -1
        best_b = -1
        first = np.argmin(loads)
        for q in range(-1, R):
            r = first if q < 0 else q
            if r == m or (q >= 0 and r == first):
                continue
            Lr = loads[r]
            g = Lm - Lr
            if g <= 0.0 or 0.5 * (Lm + Lr) >= best_val:
                continue
            half = 0.5 * g
            row = mcost[r]
            for a in range(B):
                ca = mcost[m, a]
                b0 = _first_le(row, ca - half)
                for b in range(b0 - 1, b0 + 1):
                    if b < 0 or b >= B:
                        continue
                    d = ca - row[b]
                    if d > 0.0 and d < g:
                        val = max(Lm - d, Lr + d)
                        if val < best_val:
                            best_val = val
                            best_r = r
                            best_a = a
                            best_b = b
                if best_val <= second:
                    break
            if best_val <= second:
                break
        if best_r < 0:
            break
        r = best_r
        ia = member[m, best_a]
        ib = member[r, best_b]
        ca = mcost[m, best_a]
        cb = mcost[r, best_b]
        loads[m] = loads[m] - ca + cb
        loads[r] = loads[r] + ca - cb
        out[ia] = r
        out[ib] = m
        member[m, best_a] = ib
        mcost[m, best_a] = cb
        member[r, best_b] = ia
        mcost[r, best_b] = ca
        _reinsert(member[m], mcost[m], best_a)
        _reinsert(member[r], mcost[r], best_b)
        done += 1
    return done


@njit(cache=True, parallel=True)
def _lpt_swap_steps(C, R, B, max_iters, tol, out, swaps, lower, num_chunks):
    S, n = C.shape
    per = (S + num_chunks - 1) // num_chunks
    for t in prange(num_chunks):
        loads = np.empty(R)
        member = np.empty((R, B), dtype=np.int64)
        mcost = np.empty((R, B))
        order = np.empty(n, dtype=np.int64)
        keys = np.empty(n, dtype=np.uint64)
        tmp = np.empty(n, dtype=np.uint64)
        P = 1
        while P < R:
            P *= 2
        key = np.empty(P)
        tree = np.empty(2 * P, dtype=np.int64)
        counts = np.empty(R, dtype=np.int64)
        for s in range(t * per, min(S, (t + 1) * per)):
            lb = _lpt_step(C[s], R, B, out[s], loads, member, mcost, order, keys, tmp, key, tree, counts)
            lower[s] = lb
            if max_iters > 0:
                swaps[s] = _swap_pass(R, B, max_iters, lb * (1.0 + tol), out[s], loads, member, mcost)


def _check_shape(c: np.ndarray, num_ranks: int, batch_size_per_rank: int) -> None:
    if num_ranks < 1 or batch_size_per_rank < 1:
        raise ConfigError(f"num_ranks={num_ranks} and batch_size_per_rank={batch_size_per_rank} "
                          "must both be >= 1")
    if c.ndim != 2 or c.shape[1] != num_ranks * batch_size_per_rank:
        raise ConfigError(f"step_costs has shape {c.shape}; expected [steps x {num_ranks * batch_size_per_rank}] "
                          f"(num_ranks={num_ranks} x batch_size_per_rank={batch_size_per_rank}); "
                          "regroup the costs into full global batches")


class _Threads:
    """Context manager capping numba's thread count (``None`` keeps the current setting)."""

    def __init__(self, num_threads: int | None):
        if num_threads is not None and num_threads < 1:
            raise ConfigError(f"num_threads={num_threads} must be >= 1 (or None for all cores)")
        self.n = None if num_threads is None else min(int(num_threads), numba.config.NUMBA_NUM_THREADS)
        self.prev = None

    def __enter__(self):
        if self.n is not None:
            self.prev = numba.get_num_threads()
            numba.set_num_threads(self.n)
        return self

    def __exit__(self, *exc):
        if self.prev is not None:
            numba.set_num_threads(self.prev)


def lpt_swap_steps(step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int, *,
                   max_swap_iters: int = DEFAULT_MAX_SWAP_ITERS,
                   swap_tolerance: float = DEFAULT_SWAP_TOLERANCE, num_threads: int | None = None,
                   return_stats: bool = False):
    """Sorted LPT with the per-rank count, then best-swap improvement, for many steps in parallel.

    Args:
        step_costs: shape ``[S x (R*B)]``, float64; row s holds step s's sample costs (any unit).
        num_ranks: R.
        batch_size_per_rank: B.
        max_swap_iters: cap on improving exchanges per step; 0 gives plain sorted LPT with the
            the per-rank loads of :func:`fsdata.balancer.partition.lpt_reference`.
        swap_tolerance: stop exchanging once the straggler is within this relative distance of
            the step's lower bound (:func:`fsdata.balancer.bubble.step_lower_bound`); 0 exchanges until no
            exchange helps.
        num_threads: numba threads to use (None: all, ``NUMBA_NUM_THREADS``).
        return_stats: also return per-step statistics (computed in the kernel, no extra pass).

    Returns:
        ranks, shape ``[S x (R*B)]``, int32: rank of each sample, exactly B per rank per step;
        with ``return_stats`` a tuple ``(ranks, stats)`` where ``stats`` holds float64/int64
        arrays of shape ``[S]``: ``swaps`` (exchanges made) and ``lower_bound`` (the step's lower
        bound on the straggler, as :func:`fsdata.balancer.bubble.step_lower_bound`).

    Raises:
        ConfigError: shape does not match ``R*B``, negative or non-finite costs, or bad settings.
    """
    c = np.ascontiguousarray(step_costs, dtype=np.float64)
    _check_shape(c, num_ranks, batch_size_per_rank)
    if c.size and not (np.isfinite(c).all() and c.min() >= 0):
        raise ConfigError("step_costs must be finite and >= 0; check the cost model's coefficients")
    if max_swap_iters < 0 or swap_tolerance < 0:
        raise ConfigError(f"max_swap_iters={max_swap_iters} and swap_tolerance={swap_tolerance} must be >= 0")
    out = np.empty(c.shape, dtype=np.int32)
    swaps = np.zeros(c.shape[0], dtype=np.int64)
    lower = np.zeros(c.shape[0])
    if c.shape[0]:
        with _Threads(num_threads):
            num_chunks = min(c.shape[0], 4 * numba.get_num_threads())
            _lpt_swap_steps(c, num_ranks, batch_size_per_rank, int(max_swap_iters), float(swap_tolerance),
                            out, swaps, lower, num_chunks)
    return (out, {"swaps": swaps, "lower_bound": lower}) if return_stats else out


def snake_steps(step_costs: np.ndarray, num_ranks: int, batch_size_per_rank: int) -> np.ndarray:
    """Sorted round-robin in snake order (boustrophedon), vectorised over steps.

    Samples by decreasing cost; sorted position ``p`` goes to rank ``p % R`` on even rounds
    ``p // R`` and to ``R - 1 - p % R`` on odd rounds, so every rank gets exactly B samples.

    Args:
        step_costs: shape ``[S x (R*B)]``, float.
        num_ranks: R.
        batch_size_per_rank: B.

    Returns:
        shape ``[S x (R*B)]``, int32.
    """
    c = np.asarray(step_costs, dtype=np.float64)
    _check_shape(c, num_ranks, batch_size_per_rank)
    p = np.arange(c.shape[1])
    within = p % num_ranks
    pattern = np.where((p // num_ranks) % 2 == 0, within, num_ranks - 1 - within).astype(np.int32)
    order = np.argsort(-c, axis=1, kind="stable")
    out = np.empty(c.shape, dtype=np.int32)
    np.put_along_axis(out, order, np.broadcast_to(pattern, c.shape), axis=1)
    return out
