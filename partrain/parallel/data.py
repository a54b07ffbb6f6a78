"""Data parallelism (parallel.zero_stage=0): DDP over the "dp" mesh dimension.

Each dp rank holds the whole (or tp/pp-sharded) model and a slice of the global batch; DDP
all-reduces (averages) gradients over the dp group in buckets, overlapped with backward. Under
gradient accumulation the train loop calls `no_sync()` on all but the last micro-batch, so there
is one all-reduce per optimizer step.

DDP keeps its first bucket layout for the whole run (`find_unused_parameters=True`; by default it
rebuilds the buckets after the first step in the order gradients became ready). With three or
more dp ranks the layout decides in which order gloo's ring sums each element, so a run resumed
from a checkpoint, whose first step would use the first layout again, would differ from the
uninterrupted run in the last bits. The price is one walk of the autograd graph per step, and
torch's C++ warning that no parameter was unused, once in each rank's log (it bypasses Python's
warnings filters).

Expert-parallel slices (`ep_sharded`) differ between dp ranks: DDP neither broadcasts them at
start nor averages them (partrain.parallel.expert reduces them over their own group).
"""

import warnings

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


def apply_data_parallel(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    device_ids = None if dp_mesh.device_type == "cpu" else [next(model.parameters()).device]
    experts = [name for name, p in model.named_parameters() if getattr(p, "ep_sharded", False)]
    if experts:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
    with warnings.catch_warnings():
        # Newer torch deprecates broadcast_buffers in favour of forward_sync_buffers, whose False
        # still syncs at init; broadcast_buffers=False remains the way to skip buffers entirely.
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        return DistributedDataParallel(
            model,
            process_group=dp_mesh.get_group(),
            device_ids=device_ids,
            # Buffers (the rotary tables) are derived from the config, identical on every rank.
            broadcast_buffers=False,
            gradient_as_bucket_view=True,
            find_unused_parameters=True,  # one bucket layout for the whole run (docstring)
        )
