"""The checkpoint format: one place that writes, finds, checks and reads ``fstrain train`` checkpoints.

A checkpoint is a folder ``CHECKPOINT_DIR/step-XXXXXXXX`` (``XXXXXXXX`` = steps done, 8 digits)
written with ``torch.distributed.checkpoint`` (DCP: one file per rank plus ``.metadata``), holding
``{"model": dmp.state_dict(), "optim": optimizer.state_dict()}``. It is complete once rank 0 has
written ``fstrain.json`` beside the DCP files, last:

===============  ==========================================================================
key              value
===============  ==========================================================================
``step``         global steps done (the folder's number; continues across a world-size change)
``shards_step``  steps done of the shards below (``step`` when absent: checkpoints before it)
``plan_digest``  the shards' plan digest (:func:`fstrain.data.manifest.plan_digest`; ``None``
                 when the shards record none)
``world_size``   ranks of the job that wrote it (resuming the same shards needs the same;
                 evaluating does not, DCP reshards the row-wise table)
``shards``       absolute path of the trained ``fsdata balance`` OUTPUT (informational)
``model``        :class:`fstrain.models.config.Config` as a dict (``fstrain evaluate`` rebuilds it)
``init_from``    the checkpoint whose weights the run started from (``--init-from``), or absent
===============  ==========================================================================

A folder without ``fstrain.json`` (a save cut short) is never picked for resuming. Resuming checks
identity (:func:`resume_position`): the checkpoint's ``plan_digest`` must be the shards', or the
shards' manifest must say they were resharded from it at its ``shards_step``
(``resharded_from``); anything else is refused, naming ``--init-from`` (weights only, step 0).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.autograd.profiler import record_function
from torch.distributed.checkpoint.api import CheckpointException

from fstrain.components.metrics import write_json
from fstrain.components.outputs import is_checkpoint_folder
from fstrain.components.schedule import StepSchedule
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
    if rank == 0 and os.path.lexists(path):
        if not (os.path.isdir(path) and not os.path.islink(path) and is_checkpoint_folder(path)):
            raise ConfigError(f"--checkpoint-dir {checkpoint_dir} holds {os.path.basename(path)}, which fstrain did "
                              "not write; move it away or choose another --checkpoint-dir")
        shutil.rmtree(path)
    dist.barrier()
    with record_function("## checkpoint ##"):
        dcp.save(_state(dmp, opt), checkpoint_id=path)
    dist.barrier()
    if rank == 0:
        write_json({"step": step, "world_size": world_size, **extra}, os.path.join(path, META_NAME))
    dist.barrier()
    return path


class Checkpointer:
    """The checkpoints of a training run: after every ``every_steps`` global steps and at its end
    (the training loop's schedule, :class:`fstrain.components.schedule.StepSchedule`).

    Args:
        checkpoint_dir: where ``step-XXXXXXXX`` folders go (``None``: no checkpoint at all).
        every_steps: the period on the global step (0: only at the end).
        step_offset: the global step of the shards' step 0 (a reshard's S; names use the global step).
        rank, world_size: this process's place in the job.
        extra: recorded in every checkpoint's ``fstrain.json`` (plus ``shards_step``, the shards' step).
    """

    def __init__(self, checkpoint_dir: str | None, every_steps: int = 0, *, step_offset: int = 0, rank: int = 0,
                 world_size: int = 1, extra: dict | None = None) -> None:
        self.dir = checkpoint_dir
        self.schedule = StepSchedule(every_steps=every_steps, step_offset=step_offset)
        self.rank, self.world_size, self.extra = rank, world_size, dict(extra or {})

    @property
    def periodic(self) -> bool:
        """Whether checkpoints are taken between steps (the state must then match the step done)."""
        return bool(self.dir and self.schedule.every_steps)

    def save(self, dmp, opt, step: int) -> str:
        """Save after ``step`` steps of the shards (every rank together), named by the global step.

        Raises:
            ValueError: no checkpoint folder.
        """
        if self.dir is None:
            raise ValueError("this run has no checkpoint folder")
        return save_checkpoint(dmp, opt, self.dir, self.schedule.global_step(step), self.rank, self.world_size,
                               {**self.extra, "shards_step": step})

    def after_step(self, dmp, opt, step: int, flush=None) -> bool:
        """Save when the period is due after ``step`` steps, calling ``flush()`` first (a pipeline's
        deferred update); returns whether it saved."""
        if not (self.dir and self.schedule.due(step)):
            return False
        if flush is not None:
            flush()
        self.save(dmp, opt, step)
        return True

    def finish(self, dmp, opt, step: int, start: int) -> None:
        """The end-of-run checkpoint, unless the period saved this step already or no step was trained."""
        if self.dir and not self.schedule.due(step) and step > start:
            self.save(dmp, opt, step)


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


def _init_from_advice(path: str, checkpoint_dir: str) -> str:
    return (f"to start a new run from its weights use --init-from {path} (weights only, step 0) with another "
            f"--checkpoint-dir than {checkpoint_dir}")


def resume_position(meta: dict, path: str, *, shards: str, plan_digest: str | None,
                    resharded_from: dict | None, world_size: int, checkpoint_dir: str = "") -> tuple[int, int]:
    """Where a run on ``shards`` resumes from checkpoint ``path`` (its ``fstrain.json`` ``meta``).

    Accepted pairings: the checkpoint's ``plan_digest`` equals the shards' (same run: continue at
    its ``shards_step``, same world size), or the shards' manifest has ``resharded_from ==
    {"plan_digest": <checkpoint's>, "from_step": <checkpoint's shards_step>}`` (``fsdata balance OLD
    NEW --from-step S``: start at the shards' step 0, any world size, global step continuing).

    Returns:
        ``(global_step, shards_step)``: global steps done, and the first step of ``shards`` to train.

    Raises:
        ConfigError: any other pairing, a checkpoint without ``plan_digest``, or another world size
            on the same shards (one line naming ``--init-from``).
    """
    ckpt_digest = meta.get("plan_digest")
    step = meta.get("step")
    shards_step = meta.get("shards_step", step)
    where = checkpoint_dir or os.path.dirname(path)
    if not isinstance(ckpt_digest, str) or not isinstance(step, int) or not isinstance(shards_step, int):
        raise ConfigError(f"checkpoint {path} does not record which shards it trained on (no plan_digest: written by "
                          f"an older fstrain, or shards without a plan digest), so resuming could skip or repeat "
                          f"samples; {_init_from_advice(path, where)}")
    if plan_digest is not None and ckpt_digest == plan_digest:
        if meta.get("world_size") != world_size:
            raise ConfigError(f"checkpoint {path} is from world size {meta.get('world_size')}, this job has "
                              f"{world_size}; resume with the same world size")
        return step, shards_step
    lineage = {"plan_digest": ckpt_digest, "from_step": shards_step}
    if resharded_from is not None and resharded_from == lineage:
        return step, 0
    if resharded_from is not None:
        raise ConfigError(f"{shards} was resharded from plan {resharded_from['plan_digest']} at step "
                          f"{resharded_from['from_step']}, but checkpoint {path} is plan {ckpt_digest} at step "
                          f"{shards_step}; resume from the checkpoint of that step, or "
                          f"{_init_from_advice(path, where)}")
    raise ConfigError(f"checkpoint {path} was trained on other shards (plan {ckpt_digest}, "
                      f"{meta.get('shards')}) than {shards} (plan {plan_digest}); resuming would skip or repeat "
                      f"samples; {_init_from_advice(path, where)}")


def resume_checkpoint(dmp, opt, checkpoint_dir: str, world_size: int, *, shards: str, plan_digest: str | None,
                      resharded_from: dict | None = None) -> tuple[str, int, int] | None:
    """Load the newest complete checkpoint of ``checkpoint_dir`` into ``dmp`` and ``opt`` in place,
    after :func:`resume_position` accepted it for ``shards``.

    Returns:
        ``(path, global_step, shards_step)`` of the checkpoint loaded, or ``None`` when there is none
        (start fresh).

    Raises:
        ConfigError: :func:`resume_position`'s refusals.
        FstrainError: an untrusted, truncated or unreadable checkpoint (:func:`safe_load`).
    """
    found = latest_checkpoint(checkpoint_dir)
    if not found:
        return None
    meta = read_checkpoint_meta(found[0])
    global_step, shards_step = resume_position(meta, found[0], shards=shards, plan_digest=plan_digest,
                                               resharded_from=resharded_from, world_size=world_size,
                                               checkpoint_dir=checkpoint_dir)
    load_checkpoint(dmp, opt, found[0])
    return found[0], global_step, shards_step


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
    _safe_load(state, path, lambda why: f"cannot load {path} into a model with {model} ({why}); "
                                        "pass the model flags the checkpoint was trained with")
    dmp.load_state_dict(state["model"])



def _safe_load(state: dict, path: str, message) -> None:
    """``dcp.load`` of ``state`` from ``path`` without executing code from it
    (:mod:`fstrain.components.safe_dcp`); a failure is one line: an fstrain error as it is (with
    ``path``), anything else ``ConfigError(message(why))``."""
    try:
        dcp.load(state, checkpoint_id=path, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - CheckpointException: a BaseException
        cause = first_cause(e)
        if isinstance(cause, FstrainError):
            raise type(cause)(f"{cause} ({path})") from None
        raise ConfigError(message(describe(cause))) from None

def resolve_checkpoint(path: str) -> str:
    """A ``step-XXXXXXXX`` folder as given, or the newest complete checkpoint of a ``--checkpoint-dir``.

    Raises:
        FstrainError: neither (names what to pass).
    """
    if os.path.isfile(os.path.join(path, META_NAME)):
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise FstrainError(f"{path} is neither a complete fstrain checkpoint nor a --checkpoint-dir holding one; "
                           "pass a ckpt/step-XXXXXXXX folder written by fstrain train --checkpoint-dir")
    return found[0]


def checkpoint_num_items(path: str) -> int | None:
    """``num_items`` of the model a checkpoint records (``None`` when it records no model)."""
    n = (read_checkpoint_meta(path).get("model") or {}).get("num_items")
    return n if isinstance(n, int) else None


def _copy_rows(src: torch.Tensor, target) -> None:
    """Copy ``src`` (``[n, ...]``, the checkpoint's whole table) into the first ``n`` rows of ``target``
    (a ShardedTensor's local shards, or a plain tensor), leaving the other rows as they are."""
    from torch.distributed.tensor import DTensor

    if hasattr(target, "local_shards"):  # ShardedTensor (torchrec's row-wise table)
        parts = [(s.tensor, list(s.metadata.shard_offsets)) for s in target.local_shards()]
    elif isinstance(target, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, off = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        parts = [(target.to_local(), list(off))]
    else:
        parts = [(target, [0] * target.dim())]
    n = src.shape[0]
    with torch.no_grad():
        for local, off in parts:
            lo, hi = off[0], min(off[0] + local.shape[0], n)
            if hi > lo:
                cols = slice(off[1], off[1] + local.shape[1]) if len(off) > 1 else slice(None)
                local[: hi - lo].copy_(src[lo:hi, cols].to(local.device, local.dtype))


def init_from_checkpoint(dmp, path: str, num_items: int) -> str:
    """Load only the model weights of checkpoint ``path`` into a freshly built ``dmp`` (``--init-from``).

    The optimizer is not loaded. A model with more items than the checkpoint's keeps the
    checkpoint's rows ``0 .. n_old - 1`` of every table and the fresh model's initial rows beyond
    (the run's ``--seed``); every other tensor must have the checkpoint's shape. Each rank reads the
    checkpoint's whole table once into host memory for the grown tables (``n_old x dim`` floats).

    Args:
        path: a ``step-XXXXXXXX`` folder or a ``--checkpoint-dir`` (its newest checkpoint).
        num_items: the new model's ``num_items``.

    Returns:
        The checkpoint folder loaded.

    Raises:
        ConfigError: the checkpoint has more items than ``num_items``, or other tensor shapes.
        FstrainError: not a checkpoint, or an untrusted / truncated one.
    """
    path = resolve_checkpoint(path)
    old = checkpoint_num_items(path)
    if old is not None and old > num_items:
        raise ConfigError(f"--init-from {path} has num_items {old} but this model has {num_items}; the item table "
                          f"can grow, not shrink: pass --num-items {old} or more")
    md = check_checkpoint_files(path)
    state = {"model": dmp.state_dict()}
    grown = {}
    for key, value in list(state["model"].items()):
        saved = md.state_dict_metadata.get(f"model.{key}")
        size = tuple(getattr(saved, "size", None) or ())
        cur = tuple(value.size()) if hasattr(value, "size") else ()
        if size and cur and size != cur and len(size) == len(cur) and size[1:] == cur[1:] and size[0] < cur[0]:
            grown[key] = value
            state["model"][key] = torch.zeros(size, dtype=saved.properties.dtype)
    _safe_load(state, path, lambda why: f"cannot start from {path} ({why}); pass the model flags it was trained "
                                        "with (fstrain.json's model)")
    for key, target in grown.items():
        _copy_rows(state["model"][key], target)
        state["model"][key] = target
    dmp.load_state_dict(state["model"])
    return path
