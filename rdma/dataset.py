"""CachedDataset: any map-style PyTorch dataset with its samples cached (rdma.sample_cache).

One line in a training script::

    train = CachedDataset(ImageFolder(root, transform=decode_and_resize), after=random_augment)

The wrapped dataset's ``__getitem__`` (read, decode, deterministic transforms) runs the first time
an index is asked for, in whichever process asks (a DataLoader worker); its result is stored, and
every later access, from any worker and any epoch, reads it back instead.  ``after`` (random
augmentations) runs on every access, after the cache, so augmentations stay random.  A sample
read from the cache equals, bit for bit, what the wrapped dataset returned (see
rdma.sample_codec for the types a sample may hold).

``cache``: a :class:`~rdma.sample_cache.SampleCache`; a name (str) for a cache shared with other
jobs, sized by this job's remote-memory budget (:func:`rdma.env.sample_cache_from_env`, secret in
``$DLSHARE_CACHE_SECRET``); or None for a private cache sized the same way.

torch is never imported here: a DataLoader takes any object with ``__len__`` and ``__getitem__``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rdma.sample_cache import SampleCache
from rdma.sample_codec import SampleFormatError, decode, encode


class CachedDataset:
    """See the module docstring.  ``stats()`` is the cache's, plus ``computed``: samples this
    process took from the wrapped dataset."""

    def __init__(self, dataset: Any, cache: SampleCache | str | None = None,
                 after: Callable[[Any], Any] | None = None) -> None:
        self.dataset = dataset
        n = len(dataset)
        if not isinstance(cache, SampleCache):
            from rdma.env import sample_cache_from_env

            cache = sample_cache_from_env(n, name=cache)
        if cache.slots < n:
            raise ValueError(f"the cache has {cache.slots} slots, the dataset {n} samples")
        self.cache = cache
        self.after = after
        self.computed = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} outside a dataset of {len(self)}")
        raw = self.cache.get(index)
        sample = None
        if raw is not None:
            try:
                sample = decode(raw)
            except SampleFormatError:  # its CRC held, so another writer's format: compute it here
                raw = None
        if raw is None:
            sample = self.dataset[index]
            self.computed += 1
            if not self.cache.read_only:
                self.cache.put(index, encode(sample))
        return self.after(sample) if self.after is not None else sample

    def stats(self) -> dict[str, Any]:
        return {**self.cache.stats(), "computed": self.computed}

    def close(self) -> None:
        self.cache.close()

    def __enter__(self) -> "CachedDataset":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["CachedDataset"]
