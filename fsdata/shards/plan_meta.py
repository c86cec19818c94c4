"""A plan's settings and predicted figures, typed: :class:`PlanMeta` is what a plan file records
under its ``fsdata.plan`` key (docs/fsdata.md, "Stages"), read, written and checked here only;
``fsdata finalize`` builds the manifest's plan fields from it (:meth:`PlanMeta.manifest_fields`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdata.balancer.settings import BalanceSettings, PlanSettings, RunSettings
from fsdata.errors import InputError

#: Version of the plan file's layout (columns and ``fsdata.plan`` keys).
PLAN_FORMAT_VERSION = 1

#: What a plan that fails a check should do.
_FIX = "the plan file was edited or is corrupt: rerun 'fsdata plan'"


#: The :class:`PlanMeta` fields a manifest records as its own (:meth:`PlanMeta.manifest_fields`).
MANIFEST_FIELDS = ("fsdata_version", "num_ranks", "num_steps", "batch_size_per_rank", "batch_policy", "strategy",
                   "num_samples_input", "remainder_policy", "cost_model", "seed", "predicted_bubble",
                   "baseline_predicted_bubble", "lower_bound_bubble", "input_digest", "settings")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclasses.dataclass(kw_only=True, slots=True)
class PlanMeta:
    """The settings a plan was made with and what it predicts (JSON under ``fsdata.plan``).

    Attributes:
        num_ranks: R, ranks (world size) the plan is for, >= 1.
        num_steps: S, steps per rank over all epochs, >= 0.
        batch_size_per_rank: B, samples per (step, rank) under the fixed policy (the target count
            under ``cost-budget``), >= 1.
        batch_policy, strategy, remainder_policy: the planning policies' names.
        seed: the planning seed.
        cost_model: the cost model's JSON (:meth:`fsdata.cost.CostModel.to_json`).
        predicted_bubble, baseline_predicted_bubble: predicted bubble of this plan and of equal
            counts per rank, fractions of the step time (docs/fsdata.md, "Bubble").
        lower_bound_bubble: the pigeonhole bound of the batches written, a fraction, or None.
        num_samples_input: N, input samples (rows of one epoch).
        input_digest: the input's digest (:func:`fsdata.engines.base.input_digest`).
        fsdata_version: the fsdata that made the plan.
        settings: the manifest's ``settings`` object (recorded as is).
        carried: what the input's ``fsdata convert`` metadata carries into the manifest.
        manifest_extra: manifest keys written after the known ones (``lower_bound_kind`` ...).
        plan_format_version: :data:`PLAN_FORMAT_VERSION`.
        epochs: E, when the plan holds more than one epoch's rows (None: 1).
        steps_per_epoch: S_e, when every epoch has as many steps.
        epoch_num_steps: steps of each epoch (E ints summing to S), when they differ.
        other: keys this fsdata does not know, kept as read (after the known ones).
    """

    num_ranks: int
    num_steps: int
    batch_size_per_rank: int
    batch_policy: str
    strategy: str
    remainder_policy: str
    seed: int
    cost_model: dict
    predicted_bubble: float
    baseline_predicted_bubble: float
    lower_bound_bubble: float | None
    num_samples_input: int
    input_digest: str
    fsdata_version: str
    settings: dict
    carried: dict = dataclasses.field(default_factory=dict)
    manifest_extra: dict = dataclasses.field(default_factory=dict)
    plan_format_version: int = PLAN_FORMAT_VERSION
    epochs: int | None = None
    steps_per_epoch: int | None = None
    epoch_num_steps: list[int] | None = None
    other: dict = dataclasses.field(default_factory=dict)

    #: The JSON key order of a plan file (the fields above, version first; epoch keys and others last).
    _ORDER = ("plan_format_version", "num_ranks", "num_steps", "batch_size_per_rank", "batch_policy", "strategy",
              "remainder_policy", "seed", "cost_model", "predicted_bubble", "baseline_predicted_bubble",
              "lower_bound_bubble", "num_samples_input", "input_digest", "fsdata_version", "settings", "carried",
              "manifest_extra", "epochs", "steps_per_epoch", "epoch_num_steps")
    _OPTIONAL = ("epochs", "steps_per_epoch", "epoch_num_steps")

    @property
    def num_epochs(self) -> int:
        """E (1 when the plan does not say)."""
        return 1 if self.epochs is None else int(self.epochs)

    @property
    def steps_of_epochs(self) -> list[int]:
        """Steps of each epoch: E ints summing to ``num_steps`` (equal under the fixed policy)."""
        if self.epoch_num_steps is not None:
            return [int(x) for x in self.epoch_num_steps]
        return [int(self.num_steps if self.steps_per_epoch is None else self.steps_per_epoch)] * self.num_epochs

    def set_epochs(self, epochs: int, epoch_steps: list[int], *, per_epoch_list: bool) -> None:
        """Record E epochs of ``epoch_steps`` steps: ``steps_per_epoch`` when they are equal,
        ``epoch_num_steps`` when they differ or ``per_epoch_list`` (the cost-budget policy); also
        in ``settings.epochs`` and ``manifest_extra`` (docs/format.md)."""
        per: dict[str, Any] = {"steps_per_epoch": epoch_steps[0]} if len(set(epoch_steps)) == 1 else {}
        if per_epoch_list or not per:
            per["epoch_num_steps"] = list(epoch_steps)
        self.epochs = int(epochs)
        self.steps_per_epoch = per.get("steps_per_epoch")
        self.epoch_num_steps = per.get("epoch_num_steps")
        self.settings["epochs"] = int(epochs)
        self.manifest_extra.update(epochs=int(epochs), **per)

    def to_dict(self) -> dict:
        """The ``fsdata.plan`` JSON object: known keys in :attr:`_ORDER` (optional epoch keys only
        when set), then :attr:`other`."""
        out = {}
        for k in self._ORDER:
            v = getattr(self, k)
            if v is None and k in self._OPTIONAL:
                continue
            out[k] = v
        out.update(self.other)
        return out

    @classmethod
    def from_dict(cls, meta: Any, where: str, *, num_rows: int) -> PlanMeta:
        """Check a plan file's ``fsdata.plan`` object and type it.

        Args:
            meta: the parsed JSON.
            where: the plan file, for the errors.
            num_rows: rows of the plan file (E x N).

        Raises:
            InputError: another plan format version; a key missing or of the wrong type or range;
                epochs and steps per epoch that do not match the rows and ``num_steps``.
        """
        if not isinstance(meta, dict) or meta.get("plan_format_version") != PLAN_FORMAT_VERSION:
            got = meta.get("plan_format_version") if isinstance(meta, dict) else None
            raise InputError(f"plan {where}: plan_format_version {got!r} is not {PLAN_FORMAT_VERSION}; rewrite it "
                             "with this fsdata's 'fsdata plan'")
        E, S_all = meta.get("epochs", 1), meta.get("num_steps")
        if _is_int(E) and E > max(num_rows, 1):  # before a list of E entries
            E = None
        per = meta.get("epoch_num_steps", [meta.get("steps_per_epoch")] * E if _is_int(E) else None)
        if (not _is_int(E) or E < 1 or num_rows % E
                or (E > 1 and (not isinstance(per, list) or len(per) != E
                               or not all(_is_int(x) and x > 0 for x in per) or sum(per) != S_all))):
            raise InputError(f"plan {where}: epochs {meta.get('epochs', 1)!r} and steps per epoch {per!r} do not "
                             f"match its {num_rows} rows and num_steps {S_all!r}; rewrite it with 'fsdata plan'")
        for k, lo in (("num_ranks", 1), ("num_steps", 0), ("batch_size_per_rank", 1), ("num_samples_input", 0),
                      ("seed", 0)):
            v = meta.get(k)
            if not _is_int(v) or v < lo:
                raise InputError(f"plan {where}: {k} is {v!r}, not an integer >= {lo}; {_FIX}")
        checks = {"batch_policy": str, "strategy": str, "remainder_policy": str, "input_digest": str,
                  "fsdata_version": str, "cost_model": dict, "settings": dict, "carried": dict, "manifest_extra": dict}
        for k, t in checks.items():
            if not isinstance(meta.get(k, {} if k in ("carried", "manifest_extra") else None), t):
                raise InputError(f"plan {where}: {k} is {meta.get(k)!r}, not a JSON {t.__name__}; {_FIX}")
        for k in ("predicted_bubble", "baseline_predicted_bubble", "lower_bound_bubble"):
            v = meta.get(k)
            if not _is_number(v) and not (v is None and k == "lower_bound_bubble"):
                raise InputError(f"plan {where}: {k} is {v!r}, not a number; {_FIX}")
        known = {f.name for f in dataclasses.fields(cls)} - {"other"}
        return cls(**{k: v for k, v in meta.items() if k in known},
                   other={k: v for k, v in meta.items() if k not in known})

    def manifest_fields(self) -> dict:
        """The :class:`fsdata.shards.manifest.Manifest` fields the plan decides (the rest come from
        the rank files): R, S, B, policies, seed, cost model, the three predicted figures, N, the
        input digest, the fsdata version and ``settings`` (:data:`MANIFEST_FIELDS`)."""
        return {k: getattr(self, k) for k in MANIFEST_FIELDS}

    def plan_settings(self) -> PlanSettings:
        """The :class:`~fsdata.balancer.settings.PlanSettings` this plan was made with, as it records
        them: R, B, seed, strategy, policies, epochs, and from ``settings`` the partitioner, budget,
        the requested compose window, the plan window and the cost model's name (a field the plan
        does not record keeps its default).

        Raises:
            ConfigError: a recorded value the settings refuse (an edited plan or manifest).
        """
        st = self.settings
        planned: dict[str, Any] = dict(
            num_ranks=self.num_ranks, batch_size_per_rank=self.batch_size_per_rank, seed=self.seed,
            strategy=self.strategy, batch_policy=self.batch_policy, remainder=self.remainder_policy,
            epochs=self.num_epochs)
        compose = (st.get("compose") or {}).get("compose_window_requested") or st.get("compose_window")
        for field, value in (("partitioner", st.get("partitioner")), ("budget", st.get("budget")),
                             ("compose_window", compose), ("plan_window", st.get("plan_window")),
                             ("cost_model", self.cost_model.get("name"))):
            if value is not None:
                planned[field] = value
        return PlanSettings(**planned)

    def balance_settings(self, **run: Any) -> BalanceSettings:
        """The plan's own :meth:`plan_settings` run with ``run``: the
        :class:`~fsdata.balancer.settings.RunSettings` fields (``engine``, ``ray_address``,
        ``num_threads``, ``progress``, ``bucket_compression``, ``overwrite``), which do not change
        the output, so ``fsdata write`` never holds settings that contradict the plan on disk.

        Raises:
            TypeError: ``run`` names a field that is not a RunSettings field (a planning setting).
        """
        return BalanceSettings.of(self.plan_settings(), RunSettings(**run))

    @classmethod
    def from_manifest(cls, m: Any) -> PlanMeta:
        """The plan fields a :class:`~fsdata.shards.manifest.Manifest` records
        (:meth:`manifest_fields`, read back; epochs from its ``epochs``), e.g. to plan again in
        ``fsdata verify --input``."""
        return cls(**{k: getattr(m, k) for k in MANIFEST_FIELDS}, epochs=m.epochs)
