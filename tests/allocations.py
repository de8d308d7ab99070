"""``NewTensors``: a dispatch mode recording the shape of every tensor an op makes in new memory, forward and
backward (views, in-place results and ``_unsafe_view``s share an input's storage: not new memory), to count the
``[N, V]`` buffers a loss head makes."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class NewTensors(TorchDispatchMode):
    """Records ``shapes``: one tuple per tensor an op produced in new memory, in order, and ``ops``: the op of
    each (for a failing assertion's message)."""

    def __init__(self):
        super().__init__()
        self.shapes, self.ops = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.shapes.append(tuple(t.shape))
                self.ops.append(str(func))
        return out
