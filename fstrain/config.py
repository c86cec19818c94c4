"""One config per ``fstrain train`` run, and the flags generated from it.

:class:`TrainConfig` nests the settings of each part, in the style of torchtitan's ``JobConfig``:
``model`` (:class:`fstrain.models.config.Config`), ``optim``
(:class:`fstrain.distributed.optim.OptimConfig`), ``pipeline``
(:class:`fstrain.pipelines.PipelineConfig`), ``comm`` (:class:`fstrain.distributed.comm.CommConfig`),
``checkpoint``, ``eval`` and ``metrics``. Every field is declared once, here or in its part's
dataclass, with its default and its docstring; :func:`add_config_flags` turns the fields into
``fstrain train``'s flags (type, default, choices from the registries, help from the docstring),
:func:`config_from_args` builds the config back, :func:`load_yaml` reads ``--config FILE`` and
:func:`to_yaml` prints ``--print-config``.

Flag names (public contracts, kept from earlier releases): a field's flag is ``--`` plus its name
with dashes, after its section's prefix (:data:`SECTION_PREFIX`: ``--eval-data``,
``--checkpoint-every-steps``, ``--shm-chunk-bytes``), except the names in :data:`FLAG_NAMES`
(``--pipeline``, ``--backend``, ``--metrics-dir``, ...). A boolean whose default is true gets
``--no-NAME``; one that may be ``None`` gets ``--NAME`` / ``--no-NAME``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field

from fstrain.distributed.backends import BACKEND_CHOICES
from fstrain.distributed.comm import CommConfig
from fstrain.distributed.optim import SPARSE_OPTIMIZERS, OptimConfig
from fstrain.errors import ConfigError
from fstrain.models.config import ATTENTIONS, MODELS, NEGATIVE_MODES, OBJECTIVES, Config
from fstrain.pipelines.base import NO_PIPELINE, PIPELINE_NAMES, STEP_MODES, PipelineConfig


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Checkpoints (torch.distributed.checkpoint; format in :mod:`fstrain.components.checkpoint`)."""

    dir: str | None = None
    """Where ``step-XXXXXXXX`` checkpoints go; ``None``: none."""
    every_steps: int = 0
    """Checkpoint period in steps (0: only at the end, when a checkpoint folder is set)."""
    resume: bool = False
    """Resume from the newest complete checkpoint in the checkpoint folder (start fresh if none)."""


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Held-out evaluation during training (:class:`fstrain.components.evaluator.Evaluator`)."""

    data: str | None = None
    """Evaluation file (``fsdata convert --holdout last --holdout-output``): HR@10/NDCG@10 into
    eval.parquet and the summary."""
    every_steps: int = 0
    """With an evaluation file: period in steps (0: at the end)."""
    every_epochs: int = 0
    """With an evaluation file: evaluate after every N epochs of the shards (``fsdata balance
    --epochs``; 0: by steps)."""
    max_users: int | None = None
    """With an evaluation file: evaluate a fixed seeded sample of this many users (``None``: all)."""


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """What rank 0 logs and writes."""

    dir: str | None = None
    """Write step_times.parquet, summary.json (and eval.parquet) here; ``None``: not written."""
    tensorboard_dir: str | None = None
    """Write TensorBoard event files here (loss, samples/s, per-rank compute, straggler wait,
    exposed communication per step); view with: tensorboard --logdir DIR."""
    log_every_steps: int = 10
    """Rank 0 logs loss and throughput every this many steps (0: never)."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """One training run (``fstrain train``)."""

    shards: str
    """An ``fsdata balance`` OUTPUT folder written for this world size."""
    model: Config = field(default_factory=Config)
    """The model (``num_items`` and ``objective`` left ``None`` are read from the shards)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizers."""
    pipeline: PipelineConfig = field(default_factory=lambda: PipelineConfig(name="auto"))
    """Which pipeline drives the steps (``auto``: torchrec's TrainPipelinePEC where it runs, CUDA,
    else our prioritized pipeline)."""
    comm: CommConfig = field(default_factory=lambda: CommConfig(backend="auto"))
    """Process-group backend and its transport settings."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Logs and metric files."""
    max_steps: int | None = None
    """Stop after this many steps (``None``: all)."""
    seed: int = 0
    """Init, dropout and negatives seed."""
    collective_timeout_seconds: float = 120.0
    """A rank that makes no progress for this long makes every other rank exit with one line
    naming it, the collective and the step; also the process groups' and the shm transport's
    timeout."""
    simulate_ranks: bool = False
    """One process trains on each step's whole global batch (all rank files): the update of
    num_ranks ranks, for quality measurements on a small machine."""
    progress: bool = False
    """Rank 0 shows a progress bar of the steps on stderr (``--progress``)."""

    def __post_init__(self) -> None:
        # the shm transport times out with the process groups (one setting, collective_timeout_seconds)
        shm = dataclasses.replace(self.comm.shm, timeout_seconds=self.collective_timeout_seconds)
        self.comm = dataclasses.replace(self.comm, shm=shm)

    def check(self) -> None:
        """Refuse impossible settings with one line naming the flag.

        Raises:
            ConfigError: e.g. ``--max-steps 0`` or ``--resume`` without ``--checkpoint-dir``.
        """
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"--max-steps must be >= 1, got {self.max_steps}")
        for flag, v in (("--eval-every-steps", self.eval.every_steps), ("--eval-every-epochs", self.eval.every_epochs),
                        ("--checkpoint-every-steps", self.checkpoint.every_steps)):
            if v < 0:
                raise ConfigError(f"{flag} must be >= 0, got {v}")
        if (self.eval.every_steps or self.eval.every_epochs) and not self.eval.data:
            raise ConfigError("--eval-every-steps / --eval-every-epochs need --eval-data EVAL.parquet")
        if self.checkpoint.resume and not self.checkpoint.dir:
            raise ConfigError("--resume needs --checkpoint-dir")
        if not self.collective_timeout_seconds > 0:
            raise ConfigError(f"--collective-timeout-seconds must be > 0, got {self.collective_timeout_seconds}")


#: Flag prefix of each section's fields (nested dataclasses below a section add their own field name).
SECTION_PREFIX = {"model": "", "optim": "", "pipeline": "pipeline-", "comm": "", "checkpoint": "checkpoint-",
                  "eval": "eval-", "metrics": ""}
#: Fields whose flag is not the rule's (public names of earlier releases); the first is shown in --help.
FLAG_NAMES = {
    "pipeline.name": ("--pipeline",),
    "pipeline.step_mode": ("--step-mode",),
    "comm.backend": ("--backend",),
    "checkpoint.resume": ("--resume",),
    "metrics.dir": ("--metrics-dir",),
    "metrics.log_every_steps": ("--log-every-steps", "--log-every"),
    "comm.shm.shm_dir": ("--shm-dir",),
}
#: Choices of a field, from the registries that define them.
CHOICES = {
    "model.model": MODELS, "model.objective": OBJECTIVES, "model.negatives": NEGATIVE_MODES,
    "model.attention": ATTENTIONS, "optim.sparse_optimizer": SPARSE_OPTIMIZERS,
    "pipeline.name": (*PIPELINE_NAMES, NO_PIPELINE), "pipeline.step_mode": STEP_MODES, "comm.backend": BACKEND_CHOICES,
}
#: Fields that are not flags: ``progress`` is the common ``--progress/--no-progress``; the shm
#: transport times out with ``--collective-timeout-seconds``.
NOT_FLAGS = {"progress", "comm.shm.timeout_seconds"}
#: Metavars of path-valued flags.
METAVARS = {"eval.data": "EVAL.parquet", "checkpoint.dir": "DIR", "metrics.dir": "DIR", "metrics.tensorboard_dir": "DIR"}


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it), whitespace collapsed, RST marks dropped."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    out = {}
    for a, b in zip(body, body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            text = " ".join(b.value.value.split())
            out[a.target.id] = re.sub(r":\w+:`~?([^`]+)`", r"\1", text).replace("``", "")
    return out


def _leaf_type(tp) -> tuple[type, bool]:
    """``(base type, may be None)`` of an annotation such as ``int | None``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return rest[0], len(rest) < len(args)
    return tp, False


def walk_fields(cls: type, prefix: str = ""):
    """Yield ``(path, dataclass field, annotation, docstring)`` of every leaf field, depth first."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp, _ = _leaf_type(hints[f.name])
        path = prefix + f.name
        if dataclasses.is_dataclass(tp):
            yield from walk_fields(tp, path + ".")
        else:
            yield path, f, hints[f.name], docs.get(f.name, "")


def flag_names(path: str) -> tuple[str, ...]:
    """The flag(s) of field ``path`` (``"optim.dense_lr"`` -> ``("--dense-lr",)``)."""
    if path in FLAG_NAMES:
        return FLAG_NAMES[path]
    parts = path.split(".")
    head = SECTION_PREFIX.get(parts[0], parts[0] + "-") if len(parts) > 1 else ""
    return ("--" + head + "-".join(parts[1:-1] + [parts[-1]]).replace("_", "-") if len(parts) > 1
            else "--" + parts[0].replace("_", "-"),)


def get_path(obj, path: str):
    """``obj.a.b`` for ``path = "a.b"``."""
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def add_config_flags(parser: argparse.ArgumentParser, cls: type = TrainConfig, *, defaults=None,
                     sections: tuple[str, ...] | None = None, prefix: str = "", all_none: bool = False) -> list[str]:
    """Add one flag per leaf field of ``cls`` (see the module docstring for the names).

    Args:
        parser: where the flags go (one argument group per section).
        cls: the dataclass.
        defaults: an instance whose values are the defaults (default: ``cls()`` with its required
            fields left out, i.e. the dataclass defaults).
        sections: only these top-level fields (default: all).
        prefix: the dotted path of ``cls`` inside :class:`TrainConfig` (``"model."`` for a bare
            :class:`Config`), for the flag names.
        all_none: every default is ``None``: a flag given overrides another source (a checkpoint's
            recorded config), one not given leaves it.

    Returns:
        The dotted paths added (their ``dest`` on the namespace).
    """
    added, groups = [], {}
    for path, f, tp, doc in walk_fields(cls, prefix):
        rel = path[len(prefix):]
        if path in NOT_FLAGS or f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            continue
        top = rel.split(".")[0]
        if sections is not None and top not in sections:
            continue
        default = None if all_none else get_path(defaults, rel) if defaults is not None else _default(cls, rel)
        if isinstance(default, tuple):
            default = list(default)
        group = groups.get(path.split(".")[0])
        if group is None:
            owner = cls if "." not in rel else typing.get_type_hints(cls)[top]
            title = path.split(".")[0] if "." in path else "run"
            group = groups[path.split(".")[0]] = parser.add_argument_group(
                f"{title} ({owner.__module__}.{owner.__qualname__})" if "." in path else title)
        base, nullable = _leaf_type(tp)
        names = flag_names(path)
        kw: dict = {"dest": path, "default": default, "metavar": METAVARS.get(path, path.rsplit(".", 1)[-1].upper())}
        shown = "" if default is None or default is False or all_none else f" (default {_show(default)})"
        if base is bool:
            del kw["metavar"]
            if nullable:
                kw["action"] = argparse.BooleanOptionalAction
            elif default is True or (all_none and f.default is True):
                names = tuple("--no-" + n[2:] for n in names)
                kw["action"], shown = "store_false", ""
            else:
                kw["action"] = "store_true"
        else:
            if typing.get_origin(base) is tuple:
                kw["nargs"], kw["type"] = len(typing.get_args(base)), typing.get_args(base)[0]
            else:
                kw["type"] = base
            if path in CHOICES:
                kw["choices"] = CHOICES[path]
                del kw["metavar"]
        group.add_argument(*names, help=(doc + shown).replace("%", "%%"), **kw)
        added.append(path)
    return added


def _default(cls: type, rel: str):
    """The dataclass default of field ``rel`` (dotted) of ``cls``, following default factories."""
    obj = None
    for i, part in enumerate(rel.split(".")):
        f = next(x for x in dataclasses.fields(cls if obj is None else type(obj)) if x.name == part)
        val = getattr(obj, part) if obj is not None else (
            f.default if f.default is not dataclasses.MISSING else f.default_factory())
        obj = val
    return obj


def _show(v) -> str:
    return " ".join(map(str, v)) if isinstance(v, list) else str(v)


def _default_instance(cls: type, f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def config_from_args(ns: argparse.Namespace, paths: list[str], **top) -> TrainConfig:
    """The :class:`TrainConfig` of parsed flags (``paths`` from :func:`add_config_flags`).

    Args:
        top: required top-level fields (``shards``) and fields that are not flags (``progress``).

    Raises:
        ConfigError: a value the part's dataclass refuses (its own message).
    """
    return from_dict({**{p: getattr(ns, p) for p in paths}, **top})


def from_dict(values: dict) -> TrainConfig:
    """:class:`TrainConfig` from dotted keys (``{"optim.dense_lr": 0.01, "shards": "s/"}``) or nested dicts.

    Raises:
        ConfigError: an unknown key, or a value the part's dataclass refuses.
    """
    flat = flatten(values)
    known = {p for p, *_ in walk_fields(TrainConfig)}
    unknown = sorted(set(flat) - known)
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(unknown)}; see fstrain train --print-config for the keys")
    try:
        return _make(TrainConfig, flat, "")
    except (TypeError, ValueError) as e:
        raise ConfigError(f"bad config: {e}") from None


def _make(cls: type, flat: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        tp, _ = _leaf_type(hints[f.name])
        path = prefix + f.name
        if dataclasses.is_dataclass(tp):
            if any(k.startswith(path + ".") for k in flat):
                base = _default_instance(cls, f)
                sub = _make(tp, flat, path + ".")
                # fields not given keep the section's default instance (e.g. pipeline name "auto")
                given = {g.name: getattr(sub, g.name) for g in dataclasses.fields(tp)
                         if any(k == f"{path}.{g.name}" or k.startswith(f"{path}.{g.name}.") for k in flat)}
                kw[f.name] = dataclasses.replace(base, **given)
        elif path in flat:
            v = flat[path]
            kw[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**kw)


def flatten(values: dict, prefix: str = "") -> dict:
    """``{"optim": {"dense_lr": 1}}`` -> ``{"optim.dense_lr": 1}`` (dotted keys pass unchanged)."""
    out = {}
    for k, v in values.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def to_dict(cfg) -> dict:
    """Nested plain dict of a config (tuples as lists), for YAML and JSON."""
    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        return list(v) if isinstance(v, tuple) else v

    return plain(cfg)


def to_yaml(cfg) -> str:
    """The resolved config as YAML (what ``fstrain train --print-config`` prints; ``--config`` reads it)."""
    import yaml

    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def load_yaml(path: str) -> dict:
    """Dotted keys of a ``--config`` YAML file (nested mappings as printed by ``--print-config``).

    Raises:
        ConfigError: unreadable file, not a mapping, or an unknown key.
    """
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read --config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path} is not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path} must hold a mapping of config keys (see fstrain train --print-config)")
    flat = flatten(data)
    known = {p for p, *_ in walk_fields(TrainConfig)}
    unknown = sorted(set(flat) - known)
    if unknown:
        raise ConfigError(f"--config {path}: unknown key(s) {', '.join(unknown)}; see fstrain train --print-config")
    return flat


__all__ = ["CheckpointConfig", "EvalConfig", "MetricsConfig", "TrainConfig", "add_config_flags", "config_from_args",
           "field_docs", "flag_names", "from_dict", "load_yaml", "to_dict", "to_yaml", "walk_fields"]
