"""The capture-safety checker catches planted host syncs and passes a clean decode step."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hyloop.graphs.safety import (
    CaptureSafetyChecker,
    CaptureSafetyError,
    check_capture_safe,
    sync_debug_error,
)

HIDDEN, VOCAB, SLOTS = 16, 32, 10


class TinyMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = torch.nn.Linear(4 * HIDDEN, HIDDEN)
        self.norm = torch.nn.RMSNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(F.silu(self.up(h)))
        return self.head(self.norm(h))


def make_step(
    plant: Callable[[torch.Tensor], object] | None = None, device: str = "cpu"
) -> Callable[..., torch.Tensor]:
    """A decode step: MLP, greedy argmax, write the hidden state at the output slots."""
    torch.manual_seed(0)
    model = TinyMLP().to(device)

    def step(ids: torch.Tensor, out_cache_loc: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        logits = model(ids)
        if plant is not None:
            plant(logits)
        next_ids = logits.argmax(dim=-1)
        cache.index_copy_(0, out_cache_loc, logits[:, :HIDDEN])
        return next_ids

    return step


def step_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.tensor([3, 7, 1, 0]), torch.tensor([2, 5, 6, 0]), torch.zeros(SLOTS, HIDDEN)


def test_clean_step_passes_and_matches_unchecked_run() -> None:
    step = make_step()
    ids, loc, cache = step_inputs()
    expected_cache = cache.clone()
    with torch.no_grad():
        expected = step(ids, loc, expected_cache)
        got = check_capture_safe(step, ids, loc, cache)
    assert torch.equal(got, expected)
    assert torch.equal(cache, expected_cache)
    assert cache[2].abs().sum() > 0  # the write really happened


def test_ops_a_captured_step_uses_are_allowed() -> None:
    def step(x: torch.Tensor, idx: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(x, dim=-1)
        top_vals, top_idx = probs.topk(4, dim=-1)
        sorted_vals, _ = probs.sort(dim=-1, descending=True)
        cutoff = sorted_vals.cumsum(-1) > 0.9
        masked = sorted_vals.masked_fill(cutoff, 0.0)
        picked = torch.gather(x, 1, top_idx) + torch.where(top_vals > 0.1, 1.0, 0.0)
        attn = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        mixed = torch.einsum("bhtd,bhsd->bhts", attn, q)
        hot = F.one_hot(idx, x.shape[-1]).to(x.dtype)
        rows = x[idx].to(torch.float64).to(x.dtype)  # integer indexing, dtype casts: fine
        return picked.sum() + masked.sum() + mixed.sum() + (hot * rows).sum()

    x, q = torch.randn(4, 8), torch.randn(1, 2, 3, 4)
    out = check_capture_safe(step, x, torch.tensor([0, 3, 1, 2]), q)
    assert torch.isfinite(out)


PLANTED: dict[str, Callable[[torch.Tensor], object]] = {
    "item": lambda t: t.sum().item(),
    "tolist": lambda t: t.argmax(-1).tolist(),
    "bool": lambda t: bool(t.max() > 0),
    "if_tensor": lambda t: 1 if t.sum() > 0 else 0,
    "int": lambda t: int(t.argmax()),
    "float": lambda t: float(t.max()),
    "nonzero": lambda t: torch.nonzero(t > 0),
    "where_one_arg": lambda t: torch.where(t > 0),
    "cpu": lambda t: t.cpu(),
    "numpy": lambda t: t.detach().numpy(),
    "to_cpu": lambda t: t.to("cpu"),
    "bool_mask_index": lambda t: t[t > 0],
    "bool_mask_assign": lambda t: t.detach().clone().__setitem__(t > 0, 0.0),
    "masked_select": lambda t: torch.masked_select(t, t > 0),
    "unique": lambda t: torch.unique(t.argmax(-1)),
    "one_hot_without_size": lambda t: F.one_hot(t.argmax(-1)),
    "equal": lambda t: torch.equal(t, t),
    "print": lambda t: repr(t),
    "host_tensor": lambda t: t + torch.tensor([1.0]),
    "numpy_array": lambda t: np.asarray(t.detach()),
    "cuda_synchronize": lambda t: torch.cuda.synchronize(),
    # Cross-device moves, shown with the meta device since no GPU may be present.
    "to_other_device": lambda t: t.to("meta"),
    "copy_across_devices": lambda t: torch.empty(t.shape, device="meta").copy_(t),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_host_sync_is_caught_with_the_user_frame(name: str) -> None:
    step = make_step(PLANTED[name])
    with torch.no_grad(), pytest.raises(CaptureSafetyError) as info:
        check_capture_safe(step, *step_inputs())
    message = str(info.value)
    assert info.value.op and info.value.reason
    # The frame points at the planted line in this file, not into torch or the checker.
    assert info.value.frame is not None and __file__ in info.value.frame, message
    assert "capture-unsafe op" in message


@pytest.mark.parametrize(
    ("name", "op"),
    [
        ("item", r"Tensor\.item"),
        ("tolist", r"Tensor\.tolist"),
        ("bool", "__bool__"),
        ("nonzero", r"torch\.nonzero"),
        ("cpu", r"Tensor\.cpu"),
        ("bool_mask_index", "__getitem__"),
    ],
)
def test_error_names_the_op(name: str, op: str) -> None:
    with torch.no_grad(), pytest.raises(CaptureSafetyError, match=op):
        check_capture_safe(make_step(PLANTED[name]), *step_inputs())


def test_item_is_caught_at_the_dispatcher_too() -> None:
    # Torch code (not the step) reading a value: the function mode never sees it, the dispatch
    # mode does; allclose reads its verdict with a host read.
    x = torch.randn(3)
    with pytest.raises(CaptureSafetyError, match="aten"):
        check_capture_safe(torch.allclose, x, x)


def test_checker_restores_normal_behaviour_on_exit_and_after_errors() -> None:
    x = torch.ones(3)
    with pytest.raises(CaptureSafetyError), CaptureSafetyChecker():
        x.sum().item()
    assert x.sum().item() == 3.0
    assert x.tolist() == [1.0, 1.0, 1.0]
    assert torch.cuda.synchronize.__name__ == "synchronize"
    with CaptureSafetyChecker():
        y = x * 2
    assert y.cpu().tolist() == [2.0, 2.0, 2.0]


def test_checker_is_scoped_to_its_thread() -> None:
    results: list[float] = []
    started, release = threading.Event(), threading.Event()

    def other_thread() -> None:
        started.wait(5)
        results.append(torch.ones(2).sum().item())  # not inside any check: allowed
        release.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with CaptureSafetyChecker():
        started.set()
        assert release.wait(5)
    worker.join(5)
    assert results == [2.0]


def test_checker_instance_is_not_reentrant() -> None:
    checker = CaptureSafetyChecker()
    with checker, pytest.raises(RuntimeError, match="already active"), checker:
        pass


def test_sync_debug_error_is_a_noop_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("covered by the CUDA test")
    with sync_debug_error():
        assert torch.ones(2).sum().item() == 2.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sync_debug_error_raises_on_cuda_sync_and_restores_mode() -> None:
    previous = torch.cuda.get_sync_debug_mode()
    x = torch.ones(4, device="cuda")
    with sync_debug_error():
        assert torch.cuda.get_sync_debug_mode() == 2
        with pytest.raises(RuntimeError, match="synchroniz"):
            x.sum().item()
    assert torch.cuda.get_sync_debug_mode() == previous
    # The clean step passes on CUDA under both interceptors with sync debug armed.
    step = make_step(device="cuda")
    ids, loc, cache = (t.cuda() for t in step_inputs())
    with torch.no_grad():
        out = check_capture_safe(step, ids, loc, cache)
    assert out.device.type == "cuda"
