"""The checkpoint format: one place that writes, finds, checks and reads ``fstrain train`` checkpoints.

A checkpoint is a folder ``CHECKPOINT_DIR/step-XXXXXXXX`` (``XXXXXXXX`` = steps done, 8 digits)
written with ``torch.distributed.checkpoint`` (DCP: one file per rank plus ``.metadata``), holding
``{"model": dmp.state_dict(), "optim": optimizer.state_dict()}``. It is complete once rank 0 has
written ``fstrain.json`` beside the DCP files, last:

=============  ============================================================================
key            value
=============  ============================================================================
``step``       steps done (the next step to train)
``world_size`` ranks of the job that wrote it (resuming needs the same; evaluating does not,
               DCP reshards the row-wise table)
``shards``     absolute path of the trained ``fsdata balance`` OUTPUT
``model``      :class:`fstrain.models.config.Config` as a dict (``fstrain evaluate`` rebuilds it)
=============  ============================================================================

A folder without ``fstrain.json`` (a save cut short) is never picked for resuming.
"""

from __future__ import annotations

import json
import os
import shutil

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.autograd.profiler import record_function
from torch.distributed.checkpoint.api import CheckpointException

from fstrain.components.metrics import write_json
from fstrain.components.safe_dcp import (SafeFileSystemReader, SafeLoadPlanner, check_checkpoint_files, describe,
                                        first_cause, safe_load)
from fstrain.errors import ConfigError, FstrainError

#: Folder name prefix of a checkpoint; the suffix is the step count, 8 digits.
PREFIX = "step-"
#: The file that marks a checkpoint complete and records its settings.
META_NAME = "fstrain.json"


def checkpoint_path(checkpoint_dir: str, step: int) -> str:
    """``CHECKPOINT_DIR/step-XXXXXXXX`` of ``step`` steps done."""
    return os.path.join(checkpoint_dir, f"{PREFIX}{step:08d}")


def latest_checkpoint(checkpoint_dir: str) -> tuple[str, int] | None:
    """Newest complete checkpoint ``(path, step)`` in ``checkpoint_dir``, or ``None``."""
    if not os.path.isdir(checkpoint_dir):
        return None
    best = None
    for name in os.listdir(checkpoint_dir):
        p = os.path.join(checkpoint_dir, name)
        digits = name[len(PREFIX):]
        if name.startswith(PREFIX) and digits.isdigit() and os.path.exists(os.path.join(p, META_NAME)):
            step = int(digits)
            if best is None or step > best[1]:
                best = (p, step)
    return best


def _state(dmp, opt) -> dict:
    return {"model": dmp.state_dict(), "optim": opt.state_dict()}


def save_checkpoint(dmp, opt, checkpoint_dir: str, step: int, rank: int, world_size: int, extra: dict) -> str:
    """Save with DCP into ``step-XXXXXXXX`` (every rank together; complete once ``fstrain.json`` exists).

    Args:
        dmp: the sharded model.
        opt: its optimizer.
        checkpoint_dir: parent folder.
        step: the next step to train (the number of steps done).
        rank, world_size: this process's place in the job.
        extra: recorded in ``fstrain.json`` (``shards``, ``model``).

    Returns:
        The checkpoint folder.
    """
    path = checkpoint_path(checkpoint_dir, step)
    if rank == 0 and os.path.exists(path):
        shutil.rmtree(path)
    dist.barrier()
    with record_function("## checkpoint ##"):
        dcp.save(_state(dmp, opt), checkpoint_id=path)
    dist.barrier()
    if rank == 0:
        write_json({"step": step, "world_size": world_size, **extra}, os.path.join(path, META_NAME))
    dist.barrier()
    return path


def read_checkpoint_meta(path: str) -> dict:
    """``fstrain.json`` of a checkpoint folder (step, world size, model config when recorded).

    Raises:
        FstrainError: not a complete checkpoint.
    """
    meta = os.path.join(path, META_NAME)
    if not os.path.isfile(meta):
        raise FstrainError(f"{path} is not a complete fstrain checkpoint (no {META_NAME}); pass a "
                           "ckpt/step-XXXXXXXX folder written by fstrain train --checkpoint-dir")
    try:
        with open(meta) as f:
            out = json.load(f)
    except (OSError, ValueError) as e:
        raise FstrainError(f"{meta} is unreadable or corrupt ({str(e)[:200]}); use an earlier checkpoint") from None
    if not isinstance(out, dict):
        raise FstrainError(f"{meta} is not a JSON object; use an earlier checkpoint")
    return out


def resume_checkpoint(dmp, opt, checkpoint_dir: str, world_size: int) -> tuple[str, int] | None:
    """Load the newest complete checkpoint of ``checkpoint_dir`` into ``dmp`` and ``opt`` in place.

    Returns:
        ``(path, step)`` of the checkpoint loaded, or ``None`` when there is none (start fresh).

    Raises:
        ConfigError: the checkpoint was written by another world size.
    """
    found = latest_checkpoint(checkpoint_dir)
    if not found:
        return None
    meta = read_checkpoint_meta(found[0])
    if meta.get("world_size") != world_size:
        raise ConfigError(f"checkpoint {found[0]} is from world size {meta.get('world_size')}, "
                          f"this job has {world_size}; resume with the same world size")
    load_checkpoint(dmp, opt, found[0])
    return found


def load_checkpoint(dmp, opt, path: str) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into ``dmp`` and ``opt`` in place."""
    opt.init_state()  # Adam's state is created lazily; DCP loads into existing tensors
    state = _state(dmp, opt)
    safe_load(state, path)
    dmp.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])


def load_model_weights(dmp, path: str, model: dict) -> None:
    """Load only the model of a checkpoint into ``dmp`` (any world size: DCP reshards the table).

    Args:
        model: the model config it was built with (named in the error).

    Raises:
        ConfigError: the checkpoint's tensors do not fit the model (other sizes).
    """
    state = {"model": dmp.state_dict()}
    check_checkpoint_files(path)  # truncated or untrusted: its own one-line error
    try:
        dcp.load(state, checkpoint_id=path, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - CheckpointException: a BaseException
        cause = first_cause(e)
        if isinstance(cause, FstrainError):
            raise type(cause)(f"{cause} ({path})") from None
        raise ConfigError(f"cannot load {path} into a model with {model} ({describe(cause)}); "
                          "pass the model flags the checkpoint was trained with") from None
    dmp.load_state_dict(state["model"])
