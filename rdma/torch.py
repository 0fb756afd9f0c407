"""PyTorch on remote memory: put a model's large embedding tables, or any tensor you name, in a region.

Embedding tables are where recommendation models outgrow host memory::

    from rdma import place_embeddings
    from rdma.torch import place_optimizer_state

    model = DLRM(...)                     # tables on the meta device (never allocated here) or the CPU
    region = mem.map(24 << 30, local_bytes=6 << 30)
    place_embeddings(model, region)       # every Embedding/EmbeddingBag of 64 MiB or more
    prefetch_lookups(model.emb, next_idx)  # optional: the next batch's rows, fetched during this step
    opt = torch.optim.SGD(model.parameters(), lr=0.05)  # sparse=True tables get sparse updates
    place_optimizer_state(opt, region)    # e.g. Adagrad's per-row sums of those tables

A placed table is an ordinary CPU tensor over the region's mapping, so forward,
backward and the optimisers (SGD and Adagrad with sparse gradients, or dense
ones) run unchanged.  Each placed embedding also gets a forward pre-hook that
asks the region for the units of the rows a batch looks up, all at once and
writable when the module trains, so a batch costs a few batched fetches instead
of one fault per row; :func:`prefetch_lookups` asks for the next batch's rows a
step ahead, so that fetch overlaps the step before it.

torch is imported inside the functions: importing rdma never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from rdma.region import RemoteRegion

MIN_TABLE_BYTES = 64 << 20
COPY_ROWS_BYTES = 64 << 20  # a placed tensor is copied in slices this big: no second full-size copy


def _in_region(region: RemoteRegion, t) -> bool:
    ptr = t.data_ptr()
    return region.address <= ptr < region.address + region.nbytes


def _to_region(region: RemoteRegion, t):
    """A tensor in the region with t's shape, dtype and values (zeros for a meta tensor)."""
    import torch

    out = region.tensor(t.dtype, tuple(t.shape))
    if t.is_meta:
        return out  # a fresh region reads as zeros; the caller initialises it
    flat_src, flat_dst = t.detach().reshape(-1), out.view(-1)
    step = max(1, COPY_ROWS_BYTES // max(1, t.element_size()))
    with torch.no_grad():
        for i in range(0, flat_src.numel(), step):
            flat_dst[i:i + step].copy_(flat_src[i:i + step])
    return out


def _owner(module, name: str):
    parts = name.split(".")
    for p in parts[:-1]:
        module = getattr(module, p)
    return module, parts[-1]


def place_tensors(module, region: RemoteRegion, names: Iterable[str]) -> list[str]:
    """Move the named parameters or buffers of ``module`` (``"emb.weight"``, ...) into ``region``.

    Values are copied (a meta tensor's place reads as zeros); a parameter stays a parameter with
    the same ``requires_grad``.  Returns the names moved.  Build optimisers after placing."""
    import torch

    moved = []
    for name in names:
        owner, attr = _owner(module, name)
        t = getattr(owner, attr, None)
        if not isinstance(t, torch.Tensor):
            raise KeyError(f"{name} is not a tensor of the module")
        if t.device.type not in ("cpu", "meta"):
            raise ValueError(f"{name} is on {t.device}; a region holds CPU tensors")
        if not t.is_meta and _in_region(region, t):
            continue
        new = _to_region(region, t)
        if isinstance(t, torch.nn.Parameter):
            setattr(owner, attr, torch.nn.Parameter(new, requires_grad=t.requires_grad))
        else:
            owner._buffers[attr] = new
        moved.append(name)
    return moved


def _row_units(region: RemoteRegion, weight, indices) -> np.ndarray:
    """The region's units that hold the rows ``indices`` of ``weight`` (a table in the region)."""
    import torch

    row_bytes = weight.stride(0) * weight.element_size()
    base = weight.data_ptr() - region.address
    idx = indices.detach().reshape(-1) if isinstance(indices, torch.Tensor) else torch.as_tensor(indices).reshape(-1)
    rows = torch.unique(idx).cpu().numpy().astype(np.int64)
    rows = rows[(rows >= 0) & (rows < weight.shape[0])]
    start = base + rows * row_bytes
    return np.unique(np.concatenate([start // region.unit, (start + row_bytes - 1) // region.unit]))


def _lookup_hook(region: RemoteRegion, weight):
    """Prefetch the units of the rows a lookup reads (writable when the module trains)."""
    import torch

    def pre_hook(mod, args):
        if not args or not isinstance(args[0], torch.Tensor) or args[0].numel() == 0:
            return
        region.prefetch_units(_row_units(region, weight, args[0]),
                              write=bool(mod.training and mod.weight.requires_grad), timeout=None)

    return pre_hook


def prefetch_lookups(module, indices) -> int:
    """Ask for the rows a *coming* lookup of ``module`` (an Embedding or EmbeddingBag placed by
    :func:`place_embeddings`) will read, and return at once: call it with the next batch's indices
    before this batch's step, and the fetch overlaps the step (as TorchRec's pipelines prefetch the
    next batch's embeddings).  Writable when the module trains.  Returns how many units were asked
    for; 0 for a module whose table is not in a region."""
    region = getattr(module, "_dlshare_region", None)
    if region is None or indices is None:
        return 0
    units = _row_units(region, module.weight, indices)
    if len(units):
        region.prefetch_units(units, write=bool(module.training and module.weight.requires_grad), timeout=None)
    return len(units)


def _reset_in_slices(mod, region: RemoteRegion) -> None:
    """What ``reset_parameters`` does to an embedding (normal(0, 1), the padding row zeroed), a slice
    of rows at a time: torch's normal_ makes two passes over its tensor, and a slice that fits in
    local memory keeps the second pass from fetching back what the first just wrote out."""
    import torch

    w = mod.weight
    row_bytes = max(1, w.stride(0) * w.element_size())
    step = max(1, min(16 << 20, region.local_bytes // 4) // row_bytes)
    with torch.no_grad():
        for i in range(0, w.shape[0], step):
            w[i:i + step].normal_()
        if getattr(mod, "padding_idx", None) is not None:
            w[mod.padding_idx].fill_(0)


def place_embeddings(model, region: RemoteRegion, min_bytes: int = MIN_TABLE_BYTES,
                     prefetch: bool = True) -> list[str]:
    """Move every ``nn.Embedding`` and ``nn.EmbeddingBag`` whose table is at least ``min_bytes`` into
    ``region``.  A table on the meta device is initialised there as its module would (normal(0, 1),
    the padding row zeroed), so a table bigger than local memory never exists locally.  Returns the
    names of the tables moved."""
    import torch

    moved = []
    for name, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            continue
        w = mod.weight
        if w.numel() * w.element_size() < min_bytes:
            continue
        was_meta = w.is_meta
        if not place_tensors(mod, region, ["weight"]):
            continue
        if was_meta:
            _reset_in_slices(mod, region)
        mod._dlshare_region = region  # prefetch_lookups finds the region here
        if prefetch:
            mod.register_forward_pre_hook(_lookup_hook(region, mod.weight))
        moved.append(f"{name}.weight" if name else "weight")
    return moved


def place_optimizer_state(optimizer, region: RemoteRegion, min_bytes: int = MIN_TABLE_BYTES) -> int:
    """Move the optimiser's state tensors of parameters that live in ``region`` (Adagrad's ``sum``,
    momentum buffers, ...) into it too; returns how many moved.  Call it after the optimiser is
    built (Adagrad creates its sums then) and before the first step."""
    import torch

    moved = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not _in_region(region, p):
                continue
            state: dict[str, Any] = optimizer.state.get(p, {})
            for key, value in list(state.items()):
                if (isinstance(value, torch.Tensor) and value.shape == p.shape
                        and value.numel() * value.element_size() >= min_bytes and not _in_region(region, value)):
                    state[key] = _to_region(region, value)
                    moved += 1
    return moved
