"""Epochs (E > 1): every epoch holds every sample exactly once, written in it or recorded as
dropped in it (the ``epoch`` column of ``_dropped.parquet``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fsdata import fsio
from fsdata.errors import VerifyError
from fsdata.samples.io import sorted_unique
from fsdata.shards.manifest import Manifest
from fsdata.shards.verify.recorded import out_path


def read_dropped_epochs(out: Path | str, m: Manifest, num_dropped: int) -> np.ndarray:
    """Epoch of each dropped row: the ``epoch`` column of ``_dropped.parquet`` (E > 1), else zeros."""
    if m.epochs == 1 or not m.dropped_file:
        return np.zeros(num_dropped, np.int64)
    path = out_path(out, m.dropped_file)
    try:
        fs, where = fsio.filesystem_and_path(str(path))
        t = pq.read_table(where, filesystem=fs)
    except (OSError, pa.ArrowException) as e:
        raise VerifyError(f"{path} is missing or unreadable ({str(e).splitlines()[0]}); "
                          "rerun 'fsdata balance'") from None
    if ("epoch" not in t.schema.names or not pa.types.is_integer(t.schema.field("epoch").type)
            or t.column("epoch").null_count):
        raise VerifyError(f"{path}: no integer epoch column without nulls, though the output holds {m.epochs} epochs; "
                          "rerun 'fsdata balance'")
    ep = t.column("epoch").to_numpy().astype(np.int64)
    if len(ep) and (ep.min() < 0 or ep.max() >= m.epochs):
        raise VerifyError(f"{path}: epoch {int(ep[(ep < 0) | (ep >= m.epochs)][0])} lies outside 0..{m.epochs - 1}; "
                          "rerun 'fsdata balance'")
    return ep


def first_epoch_num_samples(m: Manifest) -> int | None:
    """``first_epoch_num_samples`` of a resharded OUTPUT whose epoch 0 is a partial epoch (None: absent).

    Raises:
        VerifyError: not an integer in ``1 .. num_samples_input``, or without several epochs.
    """
    F = (m.extra or {}).get("first_epoch_num_samples")
    if F is None:
        return None
    if isinstance(F, bool) or not isinstance(F, int) or not 1 <= F <= (m.num_samples_input or 0) or m.epochs < 2:
        raise VerifyError(f"manifest first_epoch_num_samples {F!r} is not an integer in 1 .. num_samples_input of "
                          "an output of several epochs; rerun 'fsdata balance'")
    return F


def check_epochs(m: Manifest, ids: np.ndarray, steps_written: np.ndarray, dropped: np.ndarray,
                  dropped_epoch: np.ndarray) -> None:
    """Every epoch holds every sample exactly once: written in it or dropped in it (E > 1); a
    partial first epoch (``first_epoch_num_samples``) holds that many of them, each once."""
    E, first = m.epochs, m.epoch_first_steps()
    F = first_epoch_num_samples(m)
    if m.settings.get("epochs", E) != E:
        raise VerifyError(f"manifest settings.epochs is {m.settings.get('epochs')!r} but epochs is {E}; the manifest "
                          "was edited: rerun 'fsdata balance'")
    epoch = m.epoch_of_step(steps_written)
    reference = None
    for e in range(E):
        span = f"steps {int(first[e])}..{int(first[e + 1]) - 1}"
        written = ids[epoch == e]
        dropped_e = dropped[dropped_epoch == e]
        uniq, dup = sorted_unique(written)
        if dup:
            raise VerifyError(f"epoch {e} ({span}): {dup} samples appear more than once; "
                              "every epoch must hold every sample exactly once: rerun 'fsdata balance'")
        if len(dropped_e) and (sorted_unique(dropped_e)[1] or np.isin(dropped_e, uniq).any()):
            raise VerifyError(f"epoch {e}: some samples are recorded as dropped twice, or both written and dropped")
        held = np.sort(np.concatenate([written, dropped_e]))
        want = F if e == 0 and F is not None else m.num_samples_input
        if len(held) != want:
            raise VerifyError(f"epoch {e} ({span}) holds {len(held)} samples written or "
                              f"dropped, the input has {want}; every epoch must hold every sample "
                              "exactly once: rerun 'fsdata balance'")
        if e == 0 and F is not None:
            partial = held
            continue
        if reference is None:
            reference = held
        elif not np.array_equal(held, reference):
            lost = np.setdiff1d(reference, held)
            raise VerifyError(f"epoch {e} lacks {len(lost)} samples of epoch 0 (e.g. sample_id "
                              f"{lost[:3].tolist()}); every epoch must hold every sample exactly once: rerun "
                              "'fsdata balance'")
    if F is not None and not np.isin(partial, reference).all():
        raise VerifyError("the partial first epoch holds samples no whole epoch holds; rerun 'fsdata balance'")

