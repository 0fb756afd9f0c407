"""GPU-utilisation predictor from computation-graph features (after Horus).

:func:`graph_features` traces a ``torch.nn.Module`` with ``torch.fx`` on the
CPU, propagates shapes from an example input and counts, per batch:

* ``flops``: multiply-adds x 2 of convolutions, linear layers, matmuls and
  recurrent cells (the ops that dominate GPU time);
* ``params``: parameter count; ``activation_bytes``: bytes of every node's
  output (what the forward pass keeps for backward);
* the layer-type mix: fractions of conv, linear, norm, activation, pool,
  recurrent, attention, embedding and other nodes;
* ``batch_size``.

:class:`UtilisationPredictor` maps those features to (SM %, memory-bandwidth %)
with a random forest, with ``fit``/``predict``/``update`` for measured rows
(``bench/gpu_profile.py`` writes them on a GPU machine).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

MIX = ("conv", "linear", "norm", "activation", "pool", "recurrent", "attention", "embedding", "other")
FEATURES = ("log_flops", "log_params", "log_activation_bytes", "batch_size", *(f"mix_{k}" for k in MIX))


def _kind(mod: Any) -> str:
    import torch.nn as nn

    if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d)):
        return "conv"
    if isinstance(mod, nn.Linear):
        return "linear"
    if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)):
        return "norm"
    if isinstance(mod, (nn.ReLU, nn.GELU, nn.Sigmoid, nn.Tanh, nn.SiLU, nn.LeakyReLU, nn.Softmax, nn.Dropout)):
        return "activation"
    if isinstance(mod, (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)):
        return "pool"
    if isinstance(mod, (nn.LSTM, nn.GRU, nn.RNN)):
        return "recurrent"
    if isinstance(mod, nn.MultiheadAttention):
        return "attention"
    if isinstance(mod, nn.Embedding):
        return "embedding"
    return "other"


def graph_features(model: Any, example: Any, batch_size: int | None = None) -> dict[str, float]:
    """Features of ``model`` run on ``example`` (a tensor or tuple of tensors)."""
    import torch
    import torch.fx as fx
    import torch.nn as nn
    from torch.fx.passes.shape_prop import ShapeProp

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            if isinstance(m, (nn.LSTM, nn.GRU, nn.RNN, nn.MultiheadAttention)):
                return True
            return super().is_leaf_module(m, qualname)

    args = example if isinstance(example, tuple) else (example,)
    graph = Tracer().trace(model)
    gm = fx.GraphModule(model, graph)
    with torch.no_grad():
        ShapeProp(gm).propagate(*args)
    mods = dict(gm.named_modules())
    flops = 0.0
    act = 0.0
    mix = dict.fromkeys(MIX, 0)
    for node in gm.graph.nodes:
        meta = node.meta.get("tensor_meta")
        out_elems = 0
        if meta is not None and hasattr(meta, "shape"):
            out_elems = math.prod(meta.shape)
            act += out_elems * torch.empty((), dtype=meta.dtype).element_size()
        if node.op == "call_module":
            m = mods[node.target]
            k = _kind(m)
            mix[k] += 1
            if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
                kernel = math.prod(m.kernel_size)
                flops += 2.0 * out_elems * (m.in_channels // m.groups) * kernel
            elif isinstance(m, nn.Linear):
                flops += 2.0 * out_elems * m.in_features
            elif isinstance(m, (nn.LSTM, nn.GRU, nn.RNN)):
                gates = {nn.LSTM: 4, nn.GRU: 3, nn.RNN: 1}[type(m)]
                x = node.args[0].meta.get("tensor_meta")
                steps = math.prod(x.shape[:-1]) if x is not None else 1
                flops += 2.0 * steps * gates * m.hidden_size * (m.input_size + m.hidden_size) * m.num_layers
            elif isinstance(m, nn.MultiheadAttention):
                q = node.args[0].meta.get("tensor_meta")
                if q is not None:
                    tokens = math.prod(q.shape[:-1])
                    seq = q.shape[0] if not m.batch_first else q.shape[1]
                    flops += 2.0 * tokens * m.embed_dim * 4 * m.embed_dim + 4.0 * tokens * seq * m.embed_dim
        elif node.op == "call_function" and getattr(node.target, "__name__", "") in ("matmul", "bmm", "mm"):
            a = node.args[0].meta.get("tensor_meta")
            if a is not None:
                flops += 2.0 * out_elems * a.shape[-1]
            mix["linear"] += 1
        elif node.op in ("call_function", "call_method"):
            name = getattr(node.target, "__name__", str(node.target))
            mix["activation" if name in ("relu", "gelu", "sigmoid", "tanh", "softmax") else "other"] += 1
    total = max(1, sum(mix.values()))
    params = float(sum(p.numel() for p in model.parameters()))
    bs = batch_size if batch_size is not None else (args[0].shape[0] if hasattr(args[0], "shape") else 1)
    out = {"flops": flops, "params": params, "activation_bytes": act, "batch_size": float(bs)}
    out.update({f"mix_{k}": v / total for k, v in mix.items()})
    return out


def feature_vector(f: Mapping[str, float], batch_size: int | None = None) -> list[float]:
    bs = float(batch_size if batch_size else f.get("batch_size", 1.0))
    return [math.log10(1.0 + f.get("flops", 0.0)), math.log10(1.0 + f.get("params", 0.0)),
            math.log10(1.0 + f.get("activation_bytes", 0.0)), bs, *(float(f.get(f"mix_{k}", 0.0)) for k in MIX)]


class UtilisationPredictor:
    """Graph features -> (SM %, memory-bandwidth %) of the job running alone."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._X: list[list[float]] = []
        self._y: list[tuple[float, float]] = []
        self.model: Any = None

    def _fit(self) -> None:
        from sklearn.ensemble import RandomForestRegressor

        self.model = RandomForestRegressor(n_estimators=200, min_samples_leaf=1, random_state=self.seed)
        self.model.fit(np.asarray(self._X), np.asarray(self._y))

    def fit(self, features: Sequence[Mapping[str, float]], util: Sequence[tuple[float, float]]) -> "UtilisationPredictor":
        if len(features) != len(util) or not len(util):
            raise ValueError("fit needs as many utilisation rows as feature rows, and at least one")
        self._X = [feature_vector(f) for f in features]
        self._y = [(float(a), float(b)) for a, b in util]
        self._fit()
        return self

    def update(self, features: Sequence[Mapping[str, float]], util: Sequence[tuple[float, float]]) -> None:
        self._X += [feature_vector(f) for f in features]
        self._y += [(float(a), float(b)) for a, b in util]
        self._fit()

    def predict(self, features: Sequence[Mapping[str, float]]) -> np.ndarray:
        if self.model is None:
            raise RuntimeError("utilisation predictor is not fitted")
        return np.clip(self.model.predict(np.asarray([feature_vector(f) for f in features])), 0.0, 100.0)

    def predict_one(self, features: Mapping[str, float], batch_size: int | None = None) -> tuple[float, float]:
        if self.model is None:
            raise RuntimeError("utilisation predictor is not fitted")
        sm, mem = np.clip(self.model.predict(np.asarray([feature_vector(features, batch_size)]))[0], 0.0, 100.0)
        return float(sm), float(mem)

    @classmethod
    def from_rows(cls, path: str, seed: int = 0) -> "UtilisationPredictor":
        """Train on a CSV from ``bench/gpu_profile.py`` (rows with ``partner`` empty: alone)."""
        import csv

        feats, utils = [], []
        with open(path) as f:
            for n, row in enumerate(csv.DictReader(f), start=2):
                if row.get("partner"):
                    continue
                try:
                    feats.append({k: float(row[k]) for k in ("flops", "params", "activation_bytes", "batch_size")}
                                 | {f"mix_{k}": float(row[f"mix_{k}"]) for k in MIX})
                    utils.append((float(row["sm_percent"]), float(row["mem_percent"])))
                except (KeyError, ValueError) as exc:
                    raise ValueError(f"{path}: row {n}: {exc}") from None
        return cls(seed=seed).fit(feats, utils)
