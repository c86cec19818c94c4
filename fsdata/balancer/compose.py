"""Batch composition under the fixed contract: which samples share a step (issue 10, part 1).

Per-step assignment cannot go below a step's lower bound (:func:`fsdata.balancer.bubble.step_proven_bound`),
and with a heavy tail a random global batch often holds a sample that costs more than a rank's
fair share. Composition regroups the samples of ``W`` consecutive seeded-random global batches (a
*window*) into ``W`` new global batches of exactly ``R*B`` samples, so that the bound itself drops;
the per-step partitioner then gives every rank exactly ``B`` of them as before.

Algorithm ``stratified-heavy`` (per window of ``W`` steps, ``n = W*R*B`` samples):

1. Sort the window by cost, decreasing (ties broken by a seeded random key) and cut it into
   ``W*B`` *chunks* of ``R`` consecutive samples (similar costs; the partitioner can give every
   rank one sample of a chunk).
2. Heavy steps: while the heaviest chunk left is too heavy for a mixed step, i.e. its largest
   sample ``x`` plus the ``B-1`` cheapest samples of the window exceeds the per-rank mean a step
   would have with that chunk and ``B-1`` average chunks, a new step takes one chunk of the
   window's lightest samples (companions for the heavy ones), then the heaviest chunks, one at a
   time, until the estimated per-rank mean covers :data:`HEAVY_SLACK` times ``x`` plus the
   cheapest samples (or the step has ``B`` chunks). Heavy samples thus share steps in multiples
   of ``R`` (every rank gets some), spread with short ones.
3. Stratified fill: the remaining chunks, heaviest first, are dealt in rounds, one chunk per step
   with free slots per round, steps in a fresh seeded random order each round. Every step gets a
   spread of the window's costs (a stratified sample), and the heavy steps, having fewer free
   slots, leave the rounds early.
4. The window's steps are put in a seeded random order; inside a step samples keep their order
   in the original shuffle.
5. Sub-windows: the window is also composed as aligned sub-windows of ``W/4``, ``W/16``, ...
   steps (each still inside the window), and the candidate with the lowest proven bound wins,
   the smallest sub-window among equal bounds (so a sample moves no further than needed, and a
   larger window is never worse in bound than the shipped windows it contains).
6. Only where it pays: the composed window is kept only if it lowers the window's proven bound
   (``sum_s (LB_s - mean_s)``, :func:`fsdata.balancer.bubble.step_proven_bound`) by more than
   :data:`MIN_BOUND_GAIN` of ``sum_s LB_s``; otherwise the window keeps its random global batches
   (e.g. MovieLens-1M per event at B >= 8, where per-step balancing already reaches ~0).

``W = 1`` returns the global batches unchanged (today's plan, byte for byte). A window larger
than the input is the whole input (e.g. Amazon Beauty per-event at R=256, B=32 has 38 steps).
Samples only move between steps of their own window (the departure bound); the remainder (the
tail of the seeded permutation that does not fill a step) is never composed.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from fsdata.balancer.bubble import step_proven_bound
from fsdata.balancer.policies import DEFAULT_COMPOSE_WINDOW  # noqa: F401  (there: the settings load no numba)
from fsdata.errors import ConfigError

#: The composition algorithm recorded in the manifest.
ALGORITHM = "stratified-heavy"
#: Windows measured and documented in docs/balancer.md (``--compose-window``).
SHIPPED_WINDOWS = (1, 4, 16, 64, 256)
#: A heavy step takes heavy chunks until its estimated per-rank mean is this factor above its
#: heaviest sample plus the cheapest companions: steps packed exactly to their mean are hard to
#: split evenly with B per rank (measured on Amazon Beauty / Sports / Toys: 1.0 -> 0.84% and
#: 1.5 -> 0.31% bubble at R=64 B=8 W=256; 1.3-2.0 within 0.05 points of each other).
HEAVY_SLACK = 1.5
#: A window is composed only if that lowers its proven run-bubble bound by more than this (0.01 points).
MIN_BOUND_GAIN = 1e-4


@njit(cache=True)
def _deal_window(cs, W, R, B, rand, slack):
    """Step (0..W-1) of every chunk of one window, and the number of heavy steps.

    ``cs`` are the window's costs, decreasing; ``rand`` pre-drawn uniforms for the round orders.
    """
    K = W * B
    x = np.empty(K)
    m = np.empty(K)
    for k in range(K):
        x[k] = cs[k * R]
        s = 0.0
        for j in range(k * R, (k + 1) * R):
            s += cs[j]
        m[k] = s / R
    suffix = np.zeros(K + 1)
    for k in range(K - 1, -1, -1):
        suffix[k] = suffix[k + 1] + m[k]
    cmin = cs[cs.shape[0] - 1]
    step_of = np.full(K, -1, dtype=np.int64)
    free = np.full(W, B, dtype=np.int64)
    h = 0
    tail = K  # chunks tail..K-1 (the lightest) are taken as light companions of heavy steps
    t = 0
    while t < W and B > 1:
        f = (suffix[h] - suffix[tail]) / (tail - h)
        need = x[h] + (B - 1) * cmin
        if need <= m[h] + (B - 1) * f:
            break  # the heaviest chunk left fits a mixed step: stratified from here on
        need *= slack  # headroom: a heavy step packed exactly to its mean is hard to split evenly
        # a heavy step: one chunk of the lightest samples (companions of the heavy ones) ...
        tail -= 1
        step_of[tail] = t
        acc = m[tail]
        n = 1
        # ... then the heaviest chunks until the per-rank mean covers the heaviest sample
        while n < B and h < tail:
            step_of[h] = t
            acc += m[h]
            n += 1
            h += 1
            f = (suffix[h] - suffix[tail]) / (tail - h) if h < tail else 0.0
            if acc + (B - n) * f >= need:
                break
        free[t] = B - n
        t += 1
    num_heavy = t
    # stratified fill: rounds over the steps with free slots, seeded random order per round
    r = 0
    order = np.empty(W, dtype=np.int64)
    while h < tail:
        cnt = 0
        for s in range(W):
            if free[s] > 0:
                order[cnt] = s
                cnt += 1
        # Fisher-Yates with the pre-drawn uniforms
        for i in range(cnt - 1, 0, -1):
            j = int(rand[r % rand.shape[0]] * (i + 1))
            r += 1
            tmp = order[i]
            order[i] = order[j]
            order[j] = tmp
        for i in range(cnt):
            if h >= tail:
                break
            s = order[i]
            step_of[h] = s
            free[s] -= 1
            h += 1
    return step_of, num_heavy


def compose_steps(steps: np.ndarray, costs: np.ndarray, *, num_ranks: int, batch_size_per_rank: int,
                  compose_window: int, seed: int = 0, first_window: int = 0, return_info: bool = False,
                  input_bound: np.ndarray | None = None):
    """Regroup the samples of each window of ``W`` global batches into ``W`` new global batches.

    Args:
        steps: shape ``[S x R*B]``, int; input row indices of each seeded-random global batch.
        costs: shape ``[N]``, float64; predicted cost of every input row.
        num_ranks: R.
        batch_size_per_rank: B.
        compose_window: W >= 1, global batches per window (1: unchanged; larger than S: all steps).
        seed: seed of the tie-breaking and step-order randomness (same seed, same output).
        first_window: global index of the first window of ``steps``: window ``w`` draws its
            randomness from ``default_rng([seed, tag, first_window + w])``, so composing a run's
            windows in separate calls (one per plan window, :func:`fsdata.balancer.plan.plan_one_window`)
            gives the same steps as one call over all of them.
        input_bound: shape ``[S]``, float64, optional: the proven bound of each input step
            (:func:`fsdata.balancer.bubble.step_proven_bound` of ``costs[steps]``) when the caller
            has it already; computed here otherwise (the same result either way).
        return_info: also return ``{"algorithm", "compose_window", "num_windows", "windows_composed",
            "heavy_steps", "sub_window_sizes_used"}``: windows regrouped, steps built around heavy
            samples (the rest are stratified mixes), windows composed with each sub-window size.

    Returns:
        shape ``[S x R*B]``, int64: the composed global batches; window ``w`` (steps ``w*W ..
        w*W+W-1``) holds exactly the rows it held before, every row once. With ``return_info``,
        a tuple ``(steps, info)``.

    Raises:
        ConfigError: ``steps`` not ``[S x R*B]``. ``compose_window`` is a checked setting
            (:class:`fsdata.balancer.settings.PlanSettings` refuses one below 1 on construction).
    """
    R, B = int(num_ranks), int(batch_size_per_rank)
    steps = np.asarray(steps)
    if steps.ndim != 2 or steps.shape[1] != R * B:
        raise ConfigError(f"steps has shape {steps.shape}; expected [steps x {R * B}]")
    S = steps.shape[0]
    W = int(min(compose_window, max(S, 1)))
    info = {"algorithm": ALGORITHM if W > 1 else "none", "compose_window": W,
            "num_windows": -(-S // W) if S else 0, "windows_composed": 0, "heavy_steps": 0}
    if W <= 1 or S <= 1:
        out = steps.astype(np.int64, copy=True)
        return (out, info) if return_info else out
    n = R * B
    flat = steps.ravel().astype(np.int64)
    c = np.asarray(costs, dtype=np.float64)[flat]
    out = flat.copy()
    sizes_used: dict[int, int] = {}
    for w0 in range(0, S, W):
        Wn = min(W, S - w0)
        a, b = w0 * n, (w0 + Wn) * n
        before = _bound_gap(c[a:b].reshape(Wn, n), R, B,
                            None if input_bound is None else input_bound[w0:w0 + Wn])
        if Wn == 1 or before <= MIN_BOUND_GAIN:
            continue  # nothing to gain: the window keeps its random global batches
        # one stream per window, independent of the shuffle and of the other windows
        rng = np.random.default_rng([seed, 0x636F6D70, first_window + w0 // W])
        rand = rng.random(max(1, 4 * B * Wn))
        # candidates: the window composed whole, or as aligned sub-windows of W/4, W/16, ... steps
        # (still inside the window); the lowest proven bound wins, the smallest size among equals
        best = None
        size = Wn
        while size >= 2:
            parts = [_compose_block(c, a + s0 * n, min(size, Wn - s0), R, B, rng, rand) for s0 in range(0, Wn, size)]
            cand = np.concatenate([p[0] for p in parts])
            gap = _bound_gap(c[cand].reshape(Wn, n), R, B)
            if best is None or gap <= best[0] + MIN_BOUND_GAIN:
                best = (min(gap, best[0]) if best else gap, size, cand, sum(p[1] for p in parts))
            size //= 4
        gap, size, cand, num_heavy = best
        if gap < before - MIN_BOUND_GAIN:
            out[a:b] = flat[cand]
            info["windows_composed"] += 1
            info["heavy_steps"] += num_heavy
            sizes_used[size] = sizes_used.get(size, 0) + 1
    info["sub_window_sizes_used"] = {str(k): v for k, v in sorted(sizes_used.items())}
    out = out.reshape(S, n)
    return (out, info) if return_info else out


def _compose_block(c: np.ndarray, a: int, Wn: int, R: int, B: int, rng: np.random.Generator,
                   rand: np.ndarray) -> tuple[np.ndarray, int]:
    """Composed positions of the ``Wn`` steps starting at flat position ``a`` (steps 1-4 above),
    and how many of them are heavy steps."""
    n = R * B
    b = a + Wn * n
    if Wn == 1:
        return np.arange(a, b), 0
    # the block's positions by cost decreasing, ties in seeded random order
    shuffled = a + rng.permutation(b - a)
    sel = shuffled[_stable_argsort_desc(c[shuffled])]
    chunk_step, num_heavy = _deal_window(np.ascontiguousarray(c[sel]), Wn, R, B, rand, HEAVY_SLACK)
    # new local step of every position; a stable sort groups the positions by step and keeps the
    # original shuffled order inside each step
    step_of_pos = np.empty(b - a, dtype=np.uint16 if Wn < (1 << 16) else np.int64)
    step_of_pos[sel - a] = chunk_step[np.arange(b - a) // R]
    blocks = (a + np.argsort(step_of_pos, kind="stable")).reshape(Wn, n)
    return blocks[rng.permutation(Wn)].ravel(), int(num_heavy)  # the block's steps in seeded random order


def _stable_argsort_desc(values: np.ndarray) -> np.ndarray:
    """Indices by decreasing value, ties in input order (machine-independent).

    Costs usually take few distinct values (one per length): then their ranks fit 16 bits and
    numpy's stable sort is a radix sort (about 10x faster than a stable float sort).
    """
    uniq, inv = np.unique(values, return_inverse=True)
    if len(uniq) < (1 << 16):
        return np.argsort((len(uniq) - 1 - inv).astype(np.uint16), kind="stable")
    return np.argsort(-values, kind="stable")


def _bound_gap(step_costs: np.ndarray, R: int, B: int, lb: np.ndarray | None = None) -> float:
    """Proven run-bubble bound of a window's steps, ``sum(LB - mean) / sum(LB)`` (``lb``: their
    proven bounds where known)."""
    lb = step_proven_bound(step_costs, R, B) if lb is None else np.asarray(lb, dtype=np.float64)
    mean = step_costs.sum(axis=1) / R
    lb = np.maximum(lb, mean)
    total = float(lb.sum())
    return 0.0 if total <= 0 else float((lb - mean).sum() / total)
