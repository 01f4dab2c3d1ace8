"""Peak live tensor bytes on any device, CPU included (where torch has no max_memory_allocated).

`LiveBytes` is a TorchDispatchMode: every op output whose storage was not seen before counts from its creation
until that output tensor is garbage collected. Tensors created before the mode was entered do not count, so the
peak is the *extra* memory of what ran inside. An approximation (a storage kept alive only through a view of a
dead base is released early), but one that sees every [T, V] logits tensor a naive implementation creates.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(t, self._free, key)
        return out
