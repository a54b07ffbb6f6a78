"""Measured memory of one training step on this process, by tensor accounting: torch's MemTracker
(torch.distributed._tools.mem_tracker) follows every tensor the step creates and the parameters,
buffers and optimizer state it is given, by kind, on every device. Unlike the RSS of a CPU process
it is exact and repeatable; on CUDA it agrees with the caching allocator's allocated bytes."""

import torch


def _by_kind(snapshot: dict) -> dict[str, int]:
    """{"PARAM": bytes, "ACT": ..., "Total": ...} summed over devices."""
    out: dict[str, int] = {}
    for per_device in snapshot.values():
        for kind, value in per_device.items():
            name = str(kind).rsplit(".", 1)[-1]
            out[name] = out.get(name, 0) + value
    return out


def measure_step(model: torch.nn.Module, forward, backward=None, optimizer=None) -> dict:
    """Run `loss = forward()` and then `backward(loss)` (default `loss.backward()`) once, tracked.

    Returns {"loss", "activations": bytes autograd keeps at the end of the forward (what the
    backward needs), "at_forward_end": {kind: bytes}, "peak": {kind: bytes} at the step's
    highest total}. MemTracker counts a module's activations once per step: call it once per
    tracker (a new one each call)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, *([optimizer] if optimizer is not None else []))
    with tracker:
        loss = forward()
        at_end = _by_kind(tracker.get_tracker_snapshot("current"))
        (backward or (lambda value: value.backward()))(loss)
    return {"loss": loss.detach(), "activations": at_end.get("ACT", 0), "at_forward_end": at_end,
            "peak": _by_kind(tracker.get_tracker_snapshot("peak"))}
