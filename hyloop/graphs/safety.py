"""Capture-safety checks: prove a step function never waits on the host.

A CUDA graph bakes in whatever the host saw at capture, and ``torch.compile`` on CPU compiles
many host syncs without complaint, so neither backend alone proves a step safe.
``check_capture_safe(step, *args)`` runs the step eagerly and raises ``CaptureSafetyError`` at
the first host sync: a ``TorchDispatchMode`` sees every aten op (host reads such as ``.item()``
or ``if t:``, data-dependent output shapes, ``torch.equal``, cross-device copies); a
``TorchFunctionMode`` sees the Python-level calls that never reach the dispatcher
(``.tolist()``, ``.numpy()``, ``.cpu()``, printing, ``torch.tensor(host data)``, boolean-mask
indexing); ``torch.cuda`` synchronize calls are rejected in the checking thread. On CUDA,
``sync_debug_error()`` also arms ``torch.cuda.set_sync_debug_mode("error")`` (process-wide;
the modes are per thread). Hand it the eager step: it watches the ops that run, not a graph.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "CaptureSafetyChecker",
    "CaptureSafetyError",
    "check_capture_safe",
    "sync_debug_error",
]

P = ParamSpec("P")
R = TypeVar("R")

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_THIS_FILE = os.path.abspath(__file__)

_HOST_READ = "reads a tensor value on the host (.item(), bool(t), int(t), float(t), `if t:`)"
_DATA_SHAPE = "has a data-dependent output shape"
_BOOL_MASK = "boolean-mask indexing (data-dependent shape; use torch.where or masked_fill_)"

# Python-level calls the dispatcher never sees as a syncing op.
_FUNCTION_REASONS: dict[Callable[..., Any], str] = {
    torch.Tensor.item: _HOST_READ,
    torch.Tensor.__bool__: _HOST_READ,
    torch.Tensor.__int__: _HOST_READ,
    torch.Tensor.__float__: _HOST_READ,
    torch.Tensor.__index__: _HOST_READ,
    torch.Tensor.tolist: "copies the tensor into Python lists on the host",
    torch.Tensor.numpy: "copies the tensor into host memory",
    torch.Tensor.cpu: "copies the tensor to the host (a no-op on CPU, a sync on GPU)",
    torch.Tensor.__repr__: "formats tensor values on the host (print / repr)",
    torch.Tensor.__format__: "formats tensor values on the host (print / f-string)",
    torch.Tensor.__array__: "copies the tensor into a host numpy array",
    torch.tensor: "builds a tensor from host data (a blocking host-to-device copy on GPU)",
    torch.masked_select: _DATA_SHAPE,
    torch.Tensor.masked_select: _DATA_SHAPE,
    torch.Tensor.nonzero: _DATA_SHAPE,
    torch.nonzero: _DATA_SHAPE,
}


def _cpu_only_host_read(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` reads values on the host only because it runs on CPU: ``one_hot`` with
    ``num_classes`` validates its input there (on device on CUDA, no sync)."""
    if func is not torch.nn.functional.one_hot:
        return False
    # Without num_classes the output width is the input's max: a real data-dependent shape.
    num_classes = kwargs.get("num_classes", args[1] if len(args) > 1 else -1)
    on_cpu = all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor))
    return on_cpu and num_classes >= 0


# aten ops that sync without carrying the data_dependent_output / dynamic_output_shape tags.
_ATEN_REASONS: dict[Any, str] = {
    torch.ops.aten.equal.default: "returns a host bool (torch.equal)",
}
_aten = torch.ops.aten
_INDEX_OPS = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}
_INDEX_OPS.add(_aten._index_put_impl_.default)


class CaptureSafetyError(RuntimeError):
    """A host sync or data-dependent shape inside a step that must be capturable."""

    def __init__(self, op: str, reason: str, frame: str | None) -> None:
        where = f" at {frame}" if frame else ""
        super().__init__(f"capture-unsafe op {op}{where}: {reason}")
        self.op = op
        self.reason = reason
        self.frame = frame


def _user_frame() -> str | None:
    """The innermost caller outside torch and this module, as ``file:line in func``."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if filename != _THIS_FILE and not filename.startswith(_TORCH_DIR):
            return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def _function_name(func: Any) -> str:
    """``torch.Tensor.item`` / ``torch.masked_select`` rather than torch's internal class names."""
    name = getattr(func, "__qualname__", None) or repr(func)
    for internal, public in (("TensorBase.", "Tensor."), ("_VariableFunctionsClass.", "")):
        if name.startswith(internal):
            name = public + name[len(internal) :]
    return name if name.startswith("Tensor.") else f"torch.{name.rsplit('.', 1)[-1]}"


def _reject(op: str, reason: str) -> CaptureSafetyError:
    return CaptureSafetyError(op, reason, _user_frame())


def _has_bool_index(indices: Any) -> bool:
    items = indices if isinstance(indices, (tuple, list)) else (indices,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` name the same device when one leaves the index implicit."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _target_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The device a ``Tensor.to(...)`` call moves to, or None when it keeps the device."""
    candidates = [kwargs.get("device"), *args[1:2]]
    for candidate in candidates:
        if isinstance(candidate, torch.Tensor):
            return candidate.device
        if isinstance(candidate, (str, int, torch.device)) and not isinstance(candidate, bool):
            return torch.device(candidate)
    return None


def _function_reason(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    reason = _FUNCTION_REASONS.get(func)
    if reason is not None:
        return reason
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
        return _BOOL_MASK if _has_bool_index(args[1]) else None
    if func is torch.Tensor.to and args:
        target = _target_device(args, kwargs)
        if target is not None and target.type == "cpu":
            return "moves the tensor to the host (a no-op on CPU, a sync on GPU)"
        if target is not None and not _same_device(target, args[0].device):
            return f"moves the tensor from {args[0].device} to {target} (a blocking copy)"
    if func is torch.as_tensor and args and not isinstance(args[0], torch.Tensor):
        return "builds a tensor from host data (a blocking host-to-device copy on GPU)"
    return None


def _aten_reason(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    if func in _INDEX_OPS:
        return _BOOL_MASK if len(args) > 1 and _has_bool_index(args[1]) else None
    reason = _ATEN_REASONS.get(func)
    if reason is not None:
        return reason
    if torch.Tag.data_dependent_output in func.tags:
        return None if getattr(_LOCAL, "cpu_only_reads", 0) > 0 else _HOST_READ
    if torch.Tag.dynamic_output_shape in func.tags:
        # one_hot and repeat_interleave have a fixed shape when the size is given explicitly.
        if func is torch.ops.aten.one_hot.default:
            num_classes = kwargs.get("num_classes", args[1] if len(args) > 1 else -1)
            return _DATA_SHAPE if num_classes < 0 else None
        if func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size"):
            return None
        return _DATA_SHAPE
    if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
        devices = [a.device for a in args[:2] if isinstance(a, torch.Tensor)]
        if kwargs.get("device") is not None:
            devices.append(torch.device(kwargs["device"]))
        if any(not _same_device(devices[0], d) for d in devices[1:]):
            return f"copies between {devices[0]} and {devices[-1]} (a blocking copy)"
    return None


_LOCAL = threading.local()


class _SyncFunctionMode(TorchFunctionMode):
    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        reason = _function_reason(func, args, kwargs)
        if reason is not None:
            raise _reject(_function_name(func), reason)
        if _cpu_only_host_read(func, args, kwargs):
            _LOCAL.cpu_only_reads = getattr(_LOCAL, "cpu_only_reads", 0) + 1
            try:
                return func(*args, **kwargs)
            finally:
                _LOCAL.cpu_only_reads -= 1
        return func(*args, **kwargs)


class _SyncDispatchMode(TorchDispatchMode):
    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        reason = _aten_reason(func, args, kwargs)
        if reason is not None:
            raise _reject(str(func), reason)
        return func(*args, **kwargs)


class _SyncCallGuard:
    """Rejects ``torch.cuda`` synchronize calls from threads that run a check.

    The patch is process-wide (module attributes), installed while any check is active and
    removed by the last one out; other threads fall through to the real call.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._local = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    def _targets(self) -> list[tuple[Any, str]]:
        targets: list[tuple[Any, str]] = [(torch.cuda, "synchronize")]
        targets += [(cls, "synchronize") for cls in (torch.cuda.Stream, torch.cuda.Event)]
        return [(owner, name) for owner, name in targets if hasattr(owner, name)]

    def _wrap(self, qualname: str, original: Any) -> Any:
        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "depth", 0) > 0:
                raise _reject(qualname, "blocks the host until the device is idle")
            return original(*args, **kwargs)

        return guarded

    def __enter__(self) -> None:
        with self._lock:
            if self._users == 0:
                for owner, name in self._targets():
                    original = getattr(owner, name)
                    self._saved.append((owner, name, original))
                    qualname = f"{getattr(owner, '__name__', owner)}.{name}"
                    setattr(owner, name, self._wrap(qualname, original))
            self._users += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        self._local.depth -= 1
        with self._lock:
            self._users -= 1
            if self._users == 0:
                for owner, name, original in reversed(self._saved):
                    setattr(owner, name, original)
                self._saved.clear()


_SYNC_CALLS = _SyncCallGuard()


@contextlib.contextmanager
def sync_debug_error() -> Iterator[None]:
    """Make CUDA raise on synchronizing calls inside the block; a no-op without CUDA.

    ``torch.cuda.set_sync_debug_mode`` is process-wide; the previous mode is restored on exit.
    """
    if not torch.cuda.is_available():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class CaptureSafetyChecker:
    """Context manager: raise ``CaptureSafetyError`` at any host sync inside the block.

    ``cuda_sync_debug`` also arms ``sync_debug_error()`` (only has an effect with CUDA).
    """

    def __init__(self, cuda_sync_debug: bool = True) -> None:
        self.cuda_sync_debug = cuda_sync_debug
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> CaptureSafetyChecker:
        if self._stack is not None:
            raise RuntimeError("CaptureSafetyChecker is already active; use a new instance")
        stack = contextlib.ExitStack()
        try:
            if self.cuda_sync_debug:
                stack.enter_context(sync_debug_error())
            stack.enter_context(_SYNC_CALLS)
            stack.enter_context(_SyncFunctionMode())
            stack.enter_context(_SyncDispatchMode())
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()


def check_capture_safe(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Run ``fn(*args, **kwargs)`` eagerly under ``CaptureSafetyChecker``; return its result."""
    with CaptureSafetyChecker():
        return fn(*args, **kwargs)
