"""Refuse forwards on weights that are not on the device.

A forward on released weights can segfault or silently return garbage, so every submodule
that holds tensors (itself or below it) gets a forward pre-hook that asks one ``check``
callable (supplied by the controller) before running. Submodules are hooked, not just the
root, because users call blocks directly; containers are hooked, not just the modules that
own tensors, because a block's forward may read a child's weight directly
(``F.linear(x, self.proj.weight)``) before calling any child.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ComputeGuard"]


class _Depth(threading.local):
    def __init__(self) -> None:
        self.n = 0  # guarded forwards of this component this thread is inside


class ComputeGuard:
    """Forward pre-hooks on ``module`` and its tensor-holding submodules calling ``check``;
    ``on_training_forward(submodule)`` is told of forwards in training mode."""

    def __init__(self, module: nn.Module, check: Callable[[], None],
                 on_training_forward: Callable[[nn.Module], None] | None = None,
                 root_check: Callable[[], None] | None = None) -> None:
        self.check = check
        self.on_training_forward = on_training_forward
        # Checked once per outermost forward into the component (e.g. the device layer's
        # stream and graph-capture check): at the root, or at a submodule called directly
        # (``vae.decoder``, one block), not again at every submodule inside.
        self.root_check = root_check
        self._depth = _Depth()
        self._handles: list[RemovableHandle] = []
        for sub in module.modules():
            if next(sub.parameters(), None) is not None or \
                    next(sub.buffers(), None) is not None or sub is module:
                self._handles.append(sub.register_forward_pre_hook(self._hook))
                self._handles.append(sub.register_forward_hook(self._leave, always_call=True))

    def _hook(self, module: nn.Module, args: Any) -> None:
        depth = self._depth
        outermost = not depth.n
        depth.n += 1  # undone by _leave, which runs even when a check below raises
        if outermost and self.root_check is not None:
            self.root_check()
        self.check()
        if module.training and self.on_training_forward is not None:
            self.on_training_forward(module)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        # (Never below 0: a pre-hook before ours may have raised, then ours did not count.)
        depth = self._depth
        depth.n = max(0, depth.n - 1)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
