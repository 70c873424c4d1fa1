"""CUDA graphs for the fixed-shape steps: `torch.compile(mode="reduce-overhead")` on a GPU, plain
eager on CPU. If compilation fails at the first call, the step falls back to eager once, loudly."""
from __future__ import annotations

import warnings

import torch


def maybe_compile(fn, mode: str | None, device: torch.device, static_buffers: tuple = ()):
    """mode: "auto" (CUDA graphs on CUDA, eager elsewhere), "eager"/None (never), or a torch.compile
    backend name for tests ("eager" backend traces with dynamo but runs eagerly, on any device)."""
    if mode == "auto":
        mode = "reduce-overhead" if device.type == "cuda" else None
    if mode is None or mode == "none":
        return fn
    for buffer in static_buffers:  # in-place cache writes inside a graph need fixed addresses
        torch._dynamo.mark_static_address(buffer)
    if mode == "reduce-overhead":
        compiled = torch.compile(fn, mode="reduce-overhead", dynamic=False)
    else:
        compiled = torch.compile(fn, backend=mode, dynamic=False)
    state = {"fn": compiled}

    def call(*args):
        try:
            return state["fn"](*args)
        except Exception as exc:  # noqa: BLE001  (any compiler failure: keep decoding, eagerly)
            if state["fn"] is fn:
                raise
            warnings.warn(f"torch.compile of {fn.__name__} failed ({type(exc).__name__}: {exc}); running eagerly")
            state["fn"] = fn
            return fn(*args)
    return call


def step_compiler(mode: str | None, device: torch.device):
    """What a drafter takes as `compile_step` (heads/drafting.py): its fixed-shape step compiled
    the same way as the target runner's fixed-size forwards."""
    return lambda fn, static_buffers=(): maybe_compile(fn, mode, device, static_buffers)
