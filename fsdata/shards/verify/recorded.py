"""What the manifest records, checked without reading a rank file: its fields and their types,
the creation settings against the top-level keys and each other, the cost model, and the
listing of OUTPUT (nothing there that the manifest does not list)."""

from __future__ import annotations

import re
from pathlib import Path

from fsdata import fsio
from fsdata.balancer import bubble, partitioners
from fsdata.balancer.cost import CostModel, load_cost_model
from fsdata.balancer.policies import BATCH_POLICIES, REMAINDER_POLICIES, STRATEGIES
from fsdata.errors import FsdataError, VerifyError
from fsdata.shards.manifest import MANIFEST_NAMES, Manifest, is_sha256, rank_dir_name, rank_file_path


def is_close(a: float, b: float) -> bool:
    """``|a - b| <= 1e-9 + 1e-9 |b|``: floats summed in another order still agree."""
    return abs(a - b) <= 1e-9 + 1e-9 * abs(b)


def recorded_cost_model(m: Manifest) -> CostModel:
    """The cost model the manifest records (3 coefficients).

    Raises:
        VerifyError: not 3 numbers, or not a cost model.
    """
    coef = m.cost_model.get("coefficients")
    if not isinstance(coef, list) or len(coef) != 3 or not all(
            isinstance(c, (int, float)) and not isinstance(c, bool) for c in coef):
        raise VerifyError(f"manifest cost_model coefficients {coef!r} are not 3 numbers [c0, c1, c2]; "
                          "rerun 'fsdata balance'")
    try:
        return load_cost_model(m.cost_model)
    except FsdataError as e:
        raise VerifyError(f"manifest cost_model: {e}") from None


_V2_SETTINGS = ("num_ranks", "batch_size_per_rank", "seed", "strategy", "batch_policy", "remainder", "partitioner")


_VERSION = re.compile(r"^\d+\.\d+(\.\d+)?([.+-]?[0-9A-Za-z.+-]*)?$")


def _check_recorded_settings(m: Manifest, where: str) -> None:
    """What the manifest records about how it was made must hang together (without the input):
    ``batch_policy`` against ``settings.budget_used`` / ``partition_info`` and the per-rank counts'
    policy, the partitioner name, ``plan_window``, the cost model's name and ``fsdata_version``."""
    s = m.settings or {}
    fix = "the manifest was edited: rerun 'fsdata balance'"
    if m.format_version >= 2 and m.fsdata_version is not None and (
            not isinstance(m.fsdata_version, str) or not _VERSION.match(m.fsdata_version)):
        raise VerifyError(f"{where}: fsdata_version {m.fsdata_version!r} is not a version; {fix}")
    if "partitioner" in s and isinstance(s["partitioner"], str) and s["partitioner"] not in partitioners.names():
        raise VerifyError(f"{where}: settings.partitioner {s['partitioner']!r} is not one of "
                          f"{', '.join(partitioners.names())}; {fix}")
    info = s.get("partition_info")
    method = info.get("method") if isinstance(info, dict) else None
    if "budget_used" in s:
        if m.batch_policy == "fixed" and s["budget_used"] is not None:
            raise VerifyError(f"{where}: batch_policy is 'fixed' but settings.budget_used is {s['budget_used']!r} "
                              f"(set by cost-budget only); {fix}")
        if m.batch_policy == "cost-budget" and m.strategy == "balanced" and not isinstance(s["budget_used"],
                                                                                          (int, float)):
            raise VerifyError(f"{where}: batch_policy is 'cost-budget' but settings.budget_used is "
                              f"{s['budget_used']!r}; {fix}")
    if (method is not None and m.strategy == "balanced"
            and (method == "cost-budget") != (m.batch_policy == "cost-budget")):
        raise VerifyError(f"{where}: batch_policy is {m.batch_policy!r} but settings.partition_info.method is "
                          f"{method!r}; {fix}")
    pw, cw = s.get("plan_window"), s.get("compose_window", 1)
    if pw is not None and (not isinstance(pw, int) or isinstance(pw, bool) or pw < 1
                           or (isinstance(cw, int) and cw >= 1 and pw % cw)):
        raise VerifyError(f"{where}: settings.plan_window {pw!r} is not a positive multiple of compose_window "
                          f"{cw!r}; {fix}")
    name = m.cost_model.get("name") if isinstance(m.cost_model, dict) else None
    if isinstance(name, str) and name.split(":", 1)[0] in ("tokens", "quadratic", "verl", "hstu", "poly"):
        try:
            named = load_cost_model(name)
        except FsdataError:
            raise VerifyError(f"{where}: cost_model name {name!r} is not a cost model; {fix}") from None
        coef = m.cost_model.get("coefficients")
        if not isinstance(coef, list) or len(coef) != 3 or any(
                not isinstance(c, (int, float)) or not is_close(float(c), float(n))
                for c, n in zip(coef, named.coefficients)):
            raise VerifyError(f"{where}: cost_model name {name!r} has coefficients {list(named.coefficients)}, "
                              f"the manifest records {coef!r}; {fix}")


def check_manifest_fields(m: Manifest, where: str) -> None:
    """Every key the manifest's version requires, of the right type, the policy names known, the
    file entries at their format's paths, and the settings agreeing with the top-level keys.

    Raises:
        VerifyError: the first key missing or wrong, naming ``where`` (the manifest file).
    """
    for value, allowed, key in ((m.strategy, STRATEGIES, "strategy"), (m.batch_policy, BATCH_POLICIES, "batch_policy"),
                                (m.remainder_policy, REMAINDER_POLICIES, "remainder_policy")):
        if value not in allowed:
            raise VerifyError(f"{where}: {key} {value!r} is not one of {', '.join(allowed)}; rerun 'fsdata balance'")
    for key in ("num_samples_input", "num_samples_written", "num_samples_dropped", "seed", "predicted_bubble",
                "step_stats_file"):
        if getattr(m, key) is None:
            raise VerifyError(f"{where} lacks '{key}'; rerun 'fsdata balance'")
    if m.format_version >= 2:
        for key in ("fsdata_version", "input_digest", "baseline_predicted_bubble", "lower_bound_bubble",
                    "step_stats_sha256"):
            if getattr(m, key) is None:
                raise VerifyError(f"{where} lacks '{key}'; rerun 'fsdata balance'")
        for key in ("step_stats_sha256", "dropped_sha256"):
            v = getattr(m, key)
            if v is not None and not is_sha256(v):
                raise VerifyError(f"{where}: {key} {v!r} is not a SHA-256 hex digest; rerun 'fsdata balance'")
        if not re.fullmatch(r"sha256-footers:[0-9a-f]{64}", m.input_digest):
            raise VerifyError(f"{where}: input_digest {m.input_digest!r} is not 'sha256-footers:<64 hex>'; "
                              "rerun 'fsdata balance'")
        if (m.dropped_sha256 is None) != (m.dropped_file is None):
            raise VerifyError(f"{where}: dropped_sha256 and dropped_file must both be set or both null; "
                              "rerun 'fsdata balance'")
    for f in m.files:
        if not is_sha256(f.sha256):
            raise VerifyError(f"{where}: the file entry of rank {f.rank} has no valid sha256 ({f.sha256!r}); "
                              "rerun 'fsdata balance'")
        if f.num_bytes is None:
            raise VerifyError(f"{where}: the file entry of rank {f.rank} has no num_bytes; rerun 'fsdata balance'")
        expected = rank_file_path(f.rank, m.format_version)
        if f.path != expected:
            raise VerifyError(f"{where}: rank {f.rank}'s file is {f.path!r}, format_version {m.format_version} "
                              f"puts it at {expected!r}; rerun 'fsdata balance'")
    if m.format_version >= 2:
        import json

        from fsdata.shards.manifest import KEYS

        raw = json.loads(fsio.read_bytes(out_path(m.path, MANIFEST_NAMES[2])).decode())
        missing = [k for k in KEYS if k not in raw]
        if missing:
            raise VerifyError(f"{where} lacks keys {missing}; rerun 'fsdata balance'")
        for k in ("predicted_bubble", "baseline_predicted_bubble", "lower_bound_bubble"):
            if raw[k] is not None and not isinstance(raw[k], float):  # fsdata writes these as JSON floats
                raise VerifyError(f"{where}: {k} is {raw[k]!r}, not a float as fsdata writes it; the manifest was "
                                  "edited: rerun 'fsdata balance'")
        missing = [k for k in _V2_SETTINGS if k not in m.settings]
        if missing:
            raise VerifyError(f"{where}: settings lacks {missing}; rerun 'fsdata balance'")
    # settings recorded in v2 must agree with the top-level keys
    s = m.settings
    for key, top in (("num_ranks", m.num_ranks), ("batch_size_per_rank", m.batch_size_per_rank), ("seed", m.seed),
                     ("strategy", m.strategy), ("batch_policy", m.batch_policy), ("remainder", m.remainder_policy)):
        if key in s and s[key] != top:
            raise VerifyError(f"{where}: settings.{key} is {s[key]!r} but "
                              f"{key if key != 'remainder' else 'remainder_policy'}"
                              f" is {top!r}; the manifest was edited: rerun 'fsdata balance'")
    _check_recorded_settings(m, where)
    if m.remainder_policy == "error" and m.num_samples_dropped:
        raise VerifyError(f"{where}: remainder_policy is 'error' but {m.num_samples_dropped} samples are recorded "
                          "as dropped")
    if m.num_samples_dropped and not m.dropped_file:
        raise VerifyError(f"{where}: {m.num_samples_dropped} samples dropped but no dropped_file; "
                          "rerun 'fsdata balance'")


def out_path(out: Path | str, *parts: str) -> Path | str:
    """``out/part/...``: a :class:`Path` for a local OUTPUT, a URI string for a remote one."""
    return fsio.join(out, *parts) if isinstance(out, str) else out.joinpath(*parts)


def check_listing(out: Path | str, m: Manifest) -> None:
    """Nothing under OUTPUT that the manifest does not list."""
    allowed_root = {MANIFEST_NAMES[m.format_version], m.step_stats_file}
    if m.dropped_file:
        allowed_root.add(m.dropped_file)
    rank_dirs = {rank_dir_name(f.rank, m.format_version): f for f in m.files}
    for name, folder in fsio.list_dir(out):
        p = out_path(out, name)
        if name in allowed_root and not folder:
            continue
        if isinstance(out, str) and name == fsio.VERSIONS_DIR and folder:
            continue  # versions of an object-store OUTPUT (a replace killed before its pointer switched)
        f = rank_dirs.get(name)
        if f is not None and folder:
            inside = sorted(q for q, _ in fsio.list_dir(p))
            want = Path(f.path).name
            extra = [n for n in inside if n != want]
            if extra:
                raise VerifyError(f"{p}: holds {extra[:5]} that the manifest does not list (only {want}); folder-level "
                                  "readers would read them: remove them or rerun 'fsdata balance'")
            continue
        kind = "folder" if folder else "file"
        raise VerifyError(f"{p}: {kind} that the manifest does not list; folder-level readers would read it: remove it "
                          "or rerun 'fsdata balance'")

def bound_kind(m) -> str:
    """Which lower-bound formula the manifest's ``lower_bound_bubble`` used (older outputs: ``simple``)."""
    kind = (m.extra or {}).get("lower_bound_kind", "simple")
    if kind not in bubble.BOUND_KINDS:
        raise VerifyError(f"manifest lower_bound_kind {kind!r} is not one of {bubble.BOUND_KINDS}; "
                          "rerun 'fsdata balance'")
    return kind


def recorded_compose_window(m) -> int:
    """The composition window the output was written with (1 when absent: older outputs)."""
    w = (m.settings or {}).get("compose_window", 1)
    if not isinstance(w, int) or isinstance(w, bool) or w < 1:
        raise VerifyError(f"manifest settings.compose_window {w!r} is not a positive integer; rerun 'fsdata balance'")
    return w


