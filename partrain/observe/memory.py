"""Measured memory of a training step on this process, by tensor accounting: every tensor storage
alive is counted once, by its bytes, from its creation to its release. Unlike the RSS of a CPU
process this is exact and repeatable; on CUDA it is what the caching allocator reports as
allocated (without the allocator's rounding).

- `StepMemory`: a dispatch mode over a whole step, any layout (DDP, DeepSpeed, pipeline
  schedules): the bytes alive when it starts (parameters, gradients, optimizer state, buffers,
  found through the garbage collector) and the peak while it runs. `train.measure_memory` uses it.
- `measure_step`: torch's MemTracker (torch.distributed._tools.mem_tracker) over one forward and
  backward of one module, by kind (parameters, activations, temporaries...): the activations a
  step keeps for its backward. MemTracker follows modules with hooks and refuses a module called
  twice in one step, so it does not fit micro-batches or pipelines; StepMemory does.
"""

import gc
import warnings
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StepMemory(TorchDispatchMode):
    """While active: `live` bytes of tensor storages on this process and their `peak`; `base` is
    what was alive when it started. Storages created by ops are seen as they are made and dropped
    when released (weak references); those alive before are found through the garbage collector."""

    def __init__(self, device=None):
        super().__init__()
        self._refs: dict[int, weakref.ref] = {}
        self._seen: set[int] = set()
        self.live = self.peak = self.base = 0
        # On CUDA also the caching allocator's own peak of the step (max_memory_allocated).
        self.device = device if device is not None and torch.device(device).type == "cuda" else None
        self.cuda_peak = -1

    def _add(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        try:
            storage = tensor.untyped_storage()
            # A fake tensor (torch.compile's tracing leaves some alive) has no data pointer.
            key = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # sparse, or a wrapper subclass
            return
        size = storage.nbytes()
        if not size or key in self._seen:
            return
        self._seen.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)

        def released(_, key=key, size=size):
            self._seen.discard(key)
            self._refs.pop(key, None)
            self.live -= size
        self._refs[key] = weakref.ref(storage, released)

    def __enter__(self):
        gc.collect()
        with warnings.catch_warnings():  # isinstance on deprecated module proxies warns
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor):
                    self._add(obj)
                    self._add(getattr(obj, "grad", None))
        self.base = self.peak = self.live
        if self.device is not None:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return super().__enter__()

    def __exit__(self, *exc):
        if self.device is not None:
            torch.cuda.synchronize(self.device)
            self.cuda_peak = torch.cuda.max_memory_allocated(self.device)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            self._add(leaf)
        return out


def per_rank(meter: StepMemory, device) -> dict[str, list[int]]:
    """Every rank's base and peak bytes, in rank order (collective: every rank calls it)."""
    import torch.distributed as dist

    mine = torch.tensor([meter.base, meter.peak, meter.cuda_peak], dtype=torch.int64,
                        device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    out = {"memory_base_bytes": [int(t[0]) for t in every],
           "memory_peak_bytes": [int(t[1]) for t in every]}
    if meter.device is not None:
        out["memory_cuda_peak_bytes"] = [int(t[2]) for t in every]
    return out


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
