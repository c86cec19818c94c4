"""Per-sample cost models: predicted compute of one sample as a function of its length L.

Every model is a polynomial ``c0 + c1*L + c2*L^2`` in the sequence length, which covers the
analytic models below and what ``fstrain calibrate`` fits on a device. Specs (``--cost-model``):

* ``tokens``: ``L`` (linear, e.g. memory-bound embedding work).
* ``quadratic``: ``L^2 + 64*L`` (the shape used in BACKGROUND.md's measurements).
* ``hstu[:d_model=256,num_heads=4,head_dim=64,num_layers=4,causal=1]``: forward matmul FLOPs of
  HSTU layers (Zhai et al. 2024, "Actions Speak Louder than Words", eqs. 1-3; layer as in
  meta-recsys/generative-recommenders' ``SequentialTransductionUnitJagged`` and fstrain's
  :class:`fstrain.models.hstu.HSTUBlock` with ``embedding_dim=d_model`` and
  ``attention_dim=linear_dim=head_dim``, as in GR's configs where ``dqk == dv``). Per layer, the
  U/V/Q/K projection ``2*L*d*4*h*dh``, the output projection ``2*L*h*dh*d``, and attention
  ``QK^T`` plus ``AV`` ``2*2*h*dh*L^2``. ``causal=1`` halves the ``L^2`` term, as fused causal
  kernels skip the masked half; ``HSTUBlock`` computes the full score matrix and masks it, and its
  counted matmul FLOPs equal ``causal=0`` exactly (tests/fstrain/test_hstu.py). Not counted:
  elementwise work (layer norms, SiLU, bias, gating, mask): by operation count about 1-3% at
  the defaults and under 10% at d_model 50.
* ``verl``: ``24576*L + L^2`` (verl's sequence balancing FLOPs proxy for a 7B LLM).
* ``poly:c0=..,c1=..,c2=..`` or a path to a JSON file
  ``{"kind": "polynomial", "coefficients": [c0, c1, c2]}`` (written by ``fstrain calibrate``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from fsdata.errors import ConfigError, setting

_HSTU_DEFAULTS = {"d_model": 256, "num_heads": 4, "head_dim": 64, "num_layers": 4, "causal": 1}


@dataclass(frozen=True, slots=True)
class CostModel:
    """Polynomial cost model ``c0 + c1*L + c2*L^2`` (units: FLOPs or seconds, as fitted).

    Attributes:
        name: the spec it was built from (recorded in manifests).
        coefficients: ``(c0, c1, c2)``.
    """

    name: str
    coefficients: tuple[float, float, float]

    def cost(self, lengths: np.ndarray) -> np.ndarray:
        """Predicted cost of each sample.

        Args:
            lengths: shape ``[N]``, any integer dtype; sequence lengths L.

        Returns:
            shape ``[N]``, float64.
        """
        L = np.asarray(lengths, dtype=np.float64)
        c0, c1, c2 = self.coefficients
        return c0 + L * (c1 + c2 * L)

    def to_json(self) -> dict:
        """JSON form recorded in manifests and read back by :func:`load_cost_model`."""
        return {"kind": "polynomial", "name": self.name, "coefficients": list(self.coefficients)}


def _parse_params(text: str, spec: str) -> dict[str, float]:
    params: dict[str, float] = {}
    if not text:
        return params
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"cost model '{spec}': parameter '{part}' is not key=value; "
                              f"example: {setting('cost_model', 'hstu:d_model=512,num_layers=8')}")
        try:
            params[key.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"cost model '{spec}': parameter {key}={value!r} is not a number") from None
    return params


def _from_json_file(path: str) -> CostModel:
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cost model file {path}: cannot read JSON ({e}); expected "
                          '{"kind": "polynomial", "coefficients": [c0, c1, c2]}') from None
    if not isinstance(obj, dict) or obj.get("kind") != "polynomial":
        raise ConfigError(f"cost model file {path}: 'kind' must be \"polynomial\"")
    coef = obj.get("coefficients")
    if (not isinstance(coef, list) or not 1 <= len(coef) <= 3
            or not all(isinstance(c, (int, float)) for c in coef)):
        raise ConfigError(f"cost model file {path}: 'coefficients' must be a list of 1-3 numbers [c0, c1, c2]")
    coef = [float(c) for c in coef] + [0.0] * (3 - len(coef))
    return _checked(CostModel(obj.get("name", f"file:{os.path.basename(path)}"), tuple(coef)))


def _checked(model: CostModel) -> CostModel:
    c = model.coefficients
    if any(not np.isfinite(x) or x < 0 for x in c) or (c[1] == 0 and c[2] == 0):
        raise ConfigError(f"cost model '{model.name}': coefficients {list(c)} must be finite, >= 0, "
                          "and c1 or c2 positive (cost must grow with length)")
    return model


def cost_model_file(spec: str | dict | None) -> str | None:
    """The file a cost-model spec reads (a ``.json`` path or any spec with a path separator), or
    None for a name (``hstu:d_model=512``) or a dict: an input for the overlap rules
    (:func:`fsdata.guards.check_output_apart`)."""
    if isinstance(spec, str) and (spec.endswith(".json") or os.path.sep in spec):
        return spec
    return None


def load_cost_model(spec: str | dict) -> CostModel:
    """Build a cost model from a CLI spec, a JSON file path, or a manifest's JSON form.

    Args:
        spec: ``tokens``, ``quadratic``, ``verl``, ``hstu[:k=v,...]``, ``poly:c0=..,c1=..,c2=..``,
            a path to a polynomial JSON file, or a dict as written by :meth:`CostModel.to_json`.

    Returns:
        The :class:`CostModel`.

    Raises:
        ConfigError: unknown name, bad parameters, unreadable file, or negative coefficients.
    """
    if isinstance(spec, dict):
        coef = spec.get("coefficients", [])
        return _checked(CostModel(spec.get("name", "polynomial"), tuple(float(c) for c in coef)))
    if cost_model_file(spec) is not None:
        if not os.path.exists(spec):
            raise ConfigError(f"cost model file {spec} does not exist; pass an existing JSON file "
                              "or a name: tokens, quadratic, verl, hstu, poly")
        return _from_json_file(spec)
    name, _, rest = spec.partition(":")
    params = _parse_params(rest, spec)
    if name == "tokens" and not params:
        return CostModel(spec, (0.0, 1.0, 0.0))
    if name == "quadratic" and not params:
        return CostModel(spec, (0.0, 64.0, 1.0))
    if name == "verl" and not params:
        return CostModel(spec, (0.0, 24576.0, 1.0))
    if name == "poly":
        unknown = set(params) - {"c0", "c1", "c2"}
        if unknown:
            raise ConfigError(f"cost model '{spec}': unknown parameters {sorted(unknown)}; use c0, c1, c2")
        return _checked(CostModel(spec, (params.get("c0", 0.0), params.get("c1", 0.0), params.get("c2", 0.0))))
    if name == "hstu":
        unknown = set(params) - set(_HSTU_DEFAULTS)
        if unknown:
            raise ConfigError(f"cost model '{spec}': unknown parameters {sorted(unknown)}; "
                              f"use {sorted(_HSTU_DEFAULTS)}")
        p = {**_HSTU_DEFAULTS, **params}
        d, h, dh, n = p["d_model"], p["num_heads"], p["head_dim"], p["num_layers"]
        if min(d, h, dh, n) <= 0:
            raise ConfigError(f"cost model '{spec}': d_model, num_heads, head_dim, num_layers must be > 0")
        linear = 2 * d * 4 * h * dh + 2 * h * dh * d
        attention = 2 * 2 * h * dh * (0.5 if p["causal"] else 1.0)
        return CostModel(spec, (0.0, float(n * linear), float(n * attention)))
    raise ConfigError(f"unknown cost model '{spec}'; use tokens, quadratic, verl, "
                      "hstu[:d_model=..,num_heads=..,head_dim=..,num_layers=..,causal=0|1], "
                      "poly:c0=..,c1=..,c2=.., or a JSON file")
