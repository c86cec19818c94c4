"""The seeded shuffle of the input rows, computable for any row on its own (windowed planning), and
the global batches cut from it (:func:`shuffled_steps`).

Global batches are consecutive runs of ``R*B`` positions of a seeded pseudo-random permutation
``P`` of the input rows ``[0, N)``: row ``i`` goes to position ``P(i)``. ``P`` is a keyed
pseudo-random permutation (a format-preserving "small-domain" cipher): a balanced Feistel network
over ``2h`` bits (``2^(2h) >= N``) with :data:`ROUNDS` rounds, restricted to ``[0, N)`` by
cycle-walking (apply the network again while the result is ``>= N``; a permutation of the larger
domain restricted this way is a permutation of ``[0, N)``: Black and Rogaway, "Ciphers with
Arbitrary Finite Domains", CT-RSA 2002, section 3). Round function: the SplitMix64 finalizer of
the right half XOR a round key (Steele, Lea, Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014); round keys from ``numpy.random.SeedSequence(seed)`` (stable across
numpy versions by NumPy's policy).

Why not ``numpy.random.default_rng(seed).permutation(N)`` (fsdata 0.1): a Fisher-Yates
shuffle cannot be computed for one range of positions without the whole array, so every engine
had to hold ``N`` entries centrally. With ``P`` a Ray task computes the positions of its own rows
(``P(offset + j)``) and routes them to their window of steps; the plan of a window needs only that
window's rows. The two shuffles give different global batches for the same seed (same
distribution: a uniformly random-looking order); the manifest records ``shuffle``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from fsdata.errors import ConfigError

#: Name of this shuffle, recorded in the manifest's ``settings.shuffle``.
SHUFFLE = "feistel-v1"
#: The shuffle of fsdata 0.1 (``numpy.random.default_rng(seed).permutation(N)``): outputs whose
#: manifest records no ``settings.shuffle`` were made with it (verify and the report still read them).
LEGACY_SHUFFLE = "numpy-permutation"
#: Feistel rounds (4 already give a pseudo-random permutation, Luby-Rackoff; 6 for margin).
ROUNDS = 6

def _round_keys(seed: int) -> np.ndarray:
    return np.random.SeedSequence([int(seed), 0x66656973]).generate_state(ROUNDS, dtype=np.uint64)


def _half_bits(num_samples: int) -> int:
    bits = max(2, int(num_samples - 1).bit_length()) if num_samples > 1 else 2
    return (bits + 1) // 2


@njit(cache=True, inline="always")
def _round_function(half, key):
    """The Feistel round function: the SplitMix64 finalizer of ``half ^ key`` (uint64)."""
    z = (half ^ key) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True, inline="always")
def _walk(x, n, h, keys, inverse):
    """The Feistel network over ``2h`` bits applied to ``x`` (``inverse``: undone, the rounds in
    reverse key order) until the value falls in ``[0, n)`` (cycle walking: read backwards, the
    forward chain's middle links lie outside ``[0, n)``, so the inverse walk retraces it)."""
    mask = np.uint64((1 << h) - 1)
    sh = np.uint64(h)
    nk = keys.shape[0]
    while True:  # expected passes <= 4 (the domain is < 4n)
        left = x >> sh
        right = x & mask
        for j in range(nk):
            if inverse:
                t = right ^ (_round_function(left, keys[nk - 1 - j]) & mask)
                right = left
                left = t
            else:
                t = left ^ (_round_function(right, keys[j]) & mask)
                left = right
                right = t
        x = (left << sh) | right
        if x < n:
            return x


@njit(cache=True, parallel=True)
def _positions(rows, n, h, keys):
    """``P(rows)``: every row independently (numba threads: the same values on any thread count)."""
    out = np.empty(rows.shape[0], dtype=np.int64)
    for i in prange(rows.shape[0]):
        out[i] = np.int64(_walk(np.uint64(rows[i]), n, h, keys, False))
    return out


@njit(cache=True, parallel=True)
def _inverse_positions(n, h, keys):
    """``P^-1(p)`` for every position ``p`` in ``[0, n)``, in position order: no random-access scatter."""
    out = np.empty(np.int64(n), dtype=np.int64)
    for p in prange(np.int64(n)):
        out[p] = np.int64(_walk(np.uint64(p), n, h, keys, True))
    return out


def shuffled_positions(rows: np.ndarray, num_samples: int, seed: int) -> np.ndarray:
    """Position of each input row in the seeded shuffle: ``P(rows)``.

    Args:
        rows: shape ``[n]``, integer input-row indices in ``[0, num_samples)`` (any subset, any order).
        num_samples: N, the number of input rows.
        seed: the shuffle's seed (``--seed``).

    Returns:
        shape ``[n]``, int64 positions in ``[0, N)``; over ``rows = arange(N)`` a permutation.

    Raises:
        ValueError: a row outside ``[0, N)``.
    """
    rows = np.asarray(rows)
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= num_samples):
        raise ValueError(f"rows must lie in [0, {num_samples})")
    return _positions(rows.astype(np.int64), np.uint64(num_samples), _half_bits(num_samples), _round_keys(seed))


def shuffled_order(num_samples: int, seed: int) -> np.ndarray:
    """The input row at each position of the seeded shuffle (the inverse of :func:`shuffled_positions`).

    Returns:
        shape ``[N]``, int64, a permutation of ``[0, N)``.
    """
    if num_samples <= 0:
        return np.empty(0, dtype=np.int64)
    # computed by the inverse network, position by position: the same permutation as inverting
    # shuffled_positions(arange(N)) (tested), without its random-access scatter
    return _inverse_positions(np.uint64(num_samples), _half_bits(num_samples), _round_keys(seed))


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s shuffle and composition (``fsdata balance --epochs``).

    Epoch 0 uses ``seed`` itself (so a one-epoch run is the run of fsdata 0.2); epoch ``e >= 1`` uses
    the first 63 bits of ``numpy.random.SeedSequence([seed, 0x65706F63, e])`` (stable across numpy
    versions by NumPy's policy), a non-negative integer that JSON keeps exactly.

    Args:
        seed: the run's seed (``--seed``), >= 0.
        epoch: the epoch, >= 0.

    Returns:
        The epoch's seed, an ``int`` in ``[0, 2**63)``.

    Raises:
        ValueError: a negative ``epoch``.
    """
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    if epoch == 0:
        return int(seed)
    state = np.random.SeedSequence([int(seed), 0x65706F63, int(epoch)]).generate_state(1, dtype=np.uint64)
    return int(state[0] >> np.uint64(1))


def shuffled_steps(num_samples: int, num_ranks: int, batch_size_per_rank: int, seed: int,
                   shuffle: str = SHUFFLE) -> tuple[np.ndarray, np.ndarray]:
    """Seeded global batches.

    Args:
        num_samples: N.
        num_ranks: R.
        batch_size_per_rank: B.
        seed: the shuffle's seed.
        shuffle: :data:`fsdata.balancer.order.SHUFFLE` (today) or :data:`LEGACY_SHUFFLE` (to re-read
            outputs of fsdata 0.1).

    Returns:
        ``(steps [S x R*B] int64 row indices, remainder [D] int64 row indices)``.

    Raises:
        ConfigError: unknown ``shuffle``.
    """
    if shuffle == SHUFFLE:
        perm = shuffled_order(num_samples, seed)
    elif shuffle == LEGACY_SHUFFLE:
        perm = np.random.default_rng(seed).permutation(num_samples)
    else:
        raise ConfigError(f"unknown shuffle {shuffle!r}; this fsdata knows {SHUFFLE!r} and {LEGACY_SHUFFLE!r}")
    per_step = num_ranks * batch_size_per_rank
    num_steps = num_samples // per_step
    return perm[: num_steps * per_step].reshape(num_steps, per_step), perm[num_steps * per_step:]
