"""One config per ``fstrain train`` run, and the flags generated from it.

:class:`TrainConfig` nests the settings of each part, in the style of torchtitan's ``JobConfig``:
``model`` (:class:`fstrain.models.config.Config`), ``optim``
(:class:`fstrain.distributed.optim.OptimConfig`), ``pipeline``
(:class:`fstrain.pipelines.PipelineConfig`), ``comm`` (:class:`fstrain.distributed.comm.CommConfig`),
``checkpoint``, ``eval`` and ``metrics``. Every field is declared once, here or in its part's
dataclass, with its default and its docstring; :func:`add_config_flags` turns the fields into
``fstrain train``'s flags (with :func:`fsdata.common.cli.add_settings_flags`, ``jsonargparse``: type,
default, choices from the registries, help from the docstring), :func:`from_dict` builds the config
back, :func:`load_yaml` reads ``--config FILE`` and :func:`to_yaml` prints ``--print-config``.

The other commands' settings live beside the function that takes them, and are re-exported here:
:class:`EvaluateConfig` (``fstrain evaluate``, :func:`fstrain.components.evaluator.evaluate_checkpoint`),
:class:`ReplayConfig` and :class:`CalibrateConfig` (:func:`fstrain.measure.replay.replay`,
:func:`fstrain.measure.calibrate.calibrate`), each with its :class:`TimingConfig` (how a batch is
timed; replay's 3 repeats, calibrate's 5: the dataclasses' defaults, the one place). Their flags are
generated the same way and parsed straight into them; their model flags are
:class:`~fstrain.models.config.Config`'s.

Flag names (public contracts, kept from earlier releases; :func:`flag_names`): a field's flag is
``--`` plus its name with dashes, after its sections' prefixes (``--eval-data``,
``--checkpoint-every-steps``, ``--shm-chunk-bytes``; a section field declares another prefix as
``metadata={"flag_prefix": ""}``: ``--dense-lr``, not ``--optim-dense-lr``), unless the field declares its
own spelling as ``metadata={"flag": "--pipeline"}`` (``--pipeline``, ``--backend``, ``--metrics-dir``,
...). A boolean whose default is true gets ``--no-NAME``; one that may be ``None`` gets ``--NAME`` /
``--no-NAME``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field

from fsdata.common.cli import add_settings_flags, settings_help
from fstrain.distributed.backends import BACKEND_CHOICES
from fstrain.components.evaluator import EvaluateConfig
from fstrain.distributed.comm import CommConfig
from fstrain.distributed.optim import SPARSE_OPTIMIZERS, OptimConfig
from fstrain.errors import ConfigError
from fstrain.measure.calibrate import CalibrateConfig
from fstrain.measure.replay import ReplayConfig, TimingConfig
from fstrain.models.config import ATTENTIONS, MODELS, NEGATIVE_MODES, OBJECTIVES, Config
from fstrain.pipelines import NO_PIPELINE, PIPELINE_NAMES, STEP_MODES, PipelineConfig


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Checkpoints (torch.distributed.checkpoint; format in :mod:`fstrain.components.checkpoint`)."""

    dir: str | None = None
    """Where ``step-XXXXXXXX`` checkpoints go; ``None``: none."""
    every_steps: int = 0
    """Checkpoint period in steps (0: only at the end, when a checkpoint folder is set)."""
    resume: bool = field(default=False, metadata={"flag": "--resume"})
    """Resume from the newest complete checkpoint in the checkpoint folder (start fresh if none); it
    must be of these shards, or of the shards these were resharded from at its step."""
    init_from: str | None = field(default=None, metadata={"flag": "--init-from"})
    """Start a new run (step 0, fresh optimizer) from the model weights of this checkpoint (a
    ``step-XXXXXXXX`` folder or a checkpoint folder: its newest); a larger ``num_items`` keeps the
    known item rows and initialises the new ones. With ``--resume``, used only when the checkpoint
    folder holds no checkpoint yet."""


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

    dir: str | None = field(default=None, metadata={"flag": "--metrics-dir"})
    """Write step_times.parquet, summary.json (and eval.parquet) here; ``None``: not written."""
    tensorboard_dir: str | None = None
    """Write TensorBoard event files here (loss, samples/s, per-rank compute, straggler wait,
    exposed communication per step); view with: tensorboard --logdir DIR."""
    log_every_steps: int = field(default=10, metadata={"flag": ("--log-every-steps", "--log-every")})
    """Rank 0 logs loss and throughput every this many steps (0: never)."""
    null_control_steps: int = 8
    """Control steps spread over the run: every rank times the same batch (no data, update or
    random draw of training), so their bubble is the timing noise under the measured one (0: none)."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """One training run (``fstrain train``)."""

    shards: str
    """An ``fsdata balance`` OUTPUT folder written for this world size."""
    model: Config = field(default_factory=Config, metadata={"flag_prefix": ""})
    """The model (``num_items`` and ``objective`` left ``None`` are read from the shards)."""
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"flag_prefix": ""})
    """Optimizers."""
    pipeline: PipelineConfig = field(default_factory=lambda: PipelineConfig(name="auto"))
    """Which pipeline drives the steps (``auto``: torchrec's TrainPipelinePEC where it runs, CUDA,
    else our prioritized pipeline)."""
    comm: CommConfig = field(default_factory=lambda: CommConfig(backend="auto"), metadata={"flag_prefix": ""})
    """Process-group backend and its transport settings."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig, metadata={"flag_prefix": ""})
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
                        ("--checkpoint-every-steps", self.checkpoint.every_steps),
                        ("--null-control-steps", self.metrics.null_control_steps)):
            if v < 0:
                raise ConfigError(f"{flag} must be >= 0, got {v}")
        if (self.eval.every_steps or self.eval.every_epochs) and not self.eval.data:
            raise ConfigError("--eval-every-steps / --eval-every-epochs need --eval-data EVAL.parquet")
        if self.checkpoint.resume and not self.checkpoint.dir:
            raise ConfigError("--resume needs --checkpoint-dir")
        if not self.collective_timeout_seconds > 0:
            raise ConfigError(f"--collective-timeout-seconds must be > 0, got {self.collective_timeout_seconds}")


#: Root of every generated flag's key in the parsed namespace (``cfg.model.embedding_dim``):
#: jsonargparse takes a key that is also a flag's name (``model`` of ``--model``) for that flag.
KEY_ROOT = "cfg"
#: Choices of a field, from the registries that define them.
CHOICES = {
    "model.model": MODELS.names(), "model.objective": OBJECTIVES, "model.negatives": NEGATIVE_MODES,
    "model.attention": ATTENTIONS, "optim.sparse_optimizer": SPARSE_OPTIMIZERS,
    "pipeline.name": (*PIPELINE_NAMES, NO_PIPELINE), "pipeline.step_mode": STEP_MODES, "comm.backend": BACKEND_CHOICES,
    "evaluate.backend": BACKEND_CHOICES,
}
#: Fields that are not flags: ``progress`` is the common ``--progress/--no-progress``; the shm
#: transport times out with ``--collective-timeout-seconds``.
NOT_FLAGS = {"progress", "comm.shm.timeout_seconds"}
#: Metavars of path-valued flags.
METAVARS = {"eval.data": "EVAL.parquet", "checkpoint.dir": "DIR", "checkpoint.init_from": "CKPT", "metrics.dir": "DIR",
            "metrics.tensorboard_dir": "DIR"}


def _leaf_type(tp) -> tuple[type, bool]:
    """``(base type, may be None)`` of an annotation such as ``int | None``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return rest[0], len(rest) < len(args)
    return tp, False


def walk_fields(cls: type, prefix: str = ""):
    """Yield ``(path, dataclass field, annotation, docstring)`` of every leaf field, depth first
    (the docstring as :func:`fsdata.common.cli.settings_help` reads it: the ``--help`` text)."""
    hints = typing.get_type_hints(cls)
    docs = settings_help(cls)
    for f in dataclasses.fields(cls):
        tp, _ = _leaf_type(hints[f.name])
        path = prefix + f.name
        if dataclasses.is_dataclass(tp):
            yield from walk_fields(tp, path + ".")
        else:
            yield path, f, hints[f.name], docs.get(f.name, "")


def sections(cls: type, prefix: str = ""):
    """Yield ``(path, dataclass)`` of ``cls`` and of every dataclass nested in it, depth first
    (``("", TrainConfig)``, ``("model", Config)``, ..., ``("comm.shm", ShmBackend.Config)``)."""
    yield prefix.rstrip("."), cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, _ = _leaf_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            yield from sections(tp, prefix + f.name + ".")


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def flag_names(path: str) -> tuple[str, ...]:
    """The flag(s) of field ``path`` of :class:`TrainConfig` (``"optim.dense_lr"`` -> ``("--dense-lr",)``):
    the field's ``metadata["flag"]`` if it has one, else ``--`` plus the sections' prefixes (a section
    field's ``metadata["flag_prefix"]``, else its name and a dash) and the field's name, with dashes."""
    cls: type = TrainConfig
    head, parts = "", path.split(".")
    for part in parts[:-1]:
        f = _field(cls, part)
        head += f.metadata.get("flag_prefix", part + "-")
        cls = _leaf_type(typing.get_type_hints(cls)[part])[0]
    flag = _field(cls, parts[-1]).metadata.get("flag")
    if flag:
        return (flag,) if isinstance(flag, str) else tuple(flag)
    return ("--" + (head + parts[-1]).replace("_", "-"),)


def get_path(obj, path: str):
    """``obj.a.b`` for ``path = "a.b"``."""
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def add_config_flags(parser, cls: type = TrainConfig, *, defaults=None, prefix: str = "",
                     override: bool = False) -> list[str]:
    """Add one flag per leaf field of ``cls`` to a ``jsonargparse`` parser (names: module docstring;
    type, default, choices and help: :func:`fsdata.common.cli.add_settings_flags`).

    Args:
        parser: where the flags go (one argument group per section).
        cls: the dataclass.
        defaults: an instance whose values are the defaults (default: the dataclass defaults,
            :class:`TrainConfig`'s with ``shards`` left out).
        prefix: the dotted path of ``cls`` inside :class:`TrainConfig` (``"model."`` for a bare
            :class:`Config`), for the flag names and the namespace keys.
        override: every default is ``None``: a flag given overrides another source (a checkpoint's
            recorded config), one not given leaves it.

    Returns:
        The dotted paths added (their keys in the parsed namespace are under :data:`KEY_ROOT`).
    """
    if defaults is None:
        defaults = cls(shards="") if cls is TrainConfig else cls()
    added = []
    for rel, sub in sections(cls):
        path = ".".join(x for x in (prefix.rstrip("."), rel) if x)
        fields = [f.name for f in dataclasses.fields(sub) if f"{path}.{f.name}".lstrip(".") not in NOT_FLAGS
                  and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)]
        title = f"{path or 'run'} ({sub.__module__}.{sub.__qualname__})"
        def key(name: str, path: str = path) -> str:
            return f"{path}.{name}".lstrip(".")

        opts = add_settings_flags(parser, sub, section=f"{KEY_ROOT}.{path}".rstrip("."), include=fields,
                                  defaults=get_path(defaults, rel) if rel else defaults, override=override,
                                  title=title, flags={n: flag_names(key(n)) for n in fields
                                                      if "flag" not in _field(sub, n).metadata},
                                  choices={n: CHOICES[key(n)] for n in fields if key(n) in CHOICES},
                                  metavars={n: METAVARS[key(n)] for n in fields if key(n) in METAVARS})
        added += [key(n) for n in dict.fromkeys(opts.values())]
    return added


def _default_instance(cls: type, f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


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


__all__ = ["CalibrateConfig", "CheckpointConfig", "EvalConfig", "EvaluateConfig", "MetricsConfig", "ReplayConfig",
           "TimingConfig", "TrainConfig", "add_config_flags", "flag_names", "from_dict", "get_path", "load_yaml",
           "sections", "to_dict", "to_yaml", "walk_fields"]
