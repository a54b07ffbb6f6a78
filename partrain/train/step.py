"""One optimizer step of one rank, and an evaluation pass: forward and backward over this rank's
micro-batches, then the data-parallel backend's reduce, clip and step.

Each micro-batch's loss is scaled by 1/micro_batches, so the accumulated gradient is that of the
mean loss for every layout. Under pp the pipeline executor runs the schedule (the loss lives on
the last stage). Otherwise the backend's `no_sync` keeps it to one gradient reduction per step.
"""

import math

import torch
import torch.distributed as dist

from partrain.data.batches import sampler_micro_batches
from partrain.models.forward import ForwardContract, output_problem
from partrain.models.loss import compiled_cross_entropy, cross_entropy
from partrain.observe.trace import Tracer
from partrain.parallel.context import shard_batch
from partrain.parallel.data import DataParallelBackend, Update
from partrain.parallel.mesh import ParallelDims, flattened
from partrain.parallel.tensor import vocab_parallel_cross_entropy


def loss_function(dims: ParallelDims, mesh, compiled: bool = False, vocab_size: int | None = None,
                  what: str = "the model"):
    """Mean cross-entropy over tokens; under tp the logits are vocabulary shards and the loss is
    computed from them without gathering (every tp rank gets the same value), each rank's
    `vocab_size` / tp wide (checked: whole logits on every rank would train on a wrong loss).
    Otherwise the chunked one, or with train.compile (`compiled`) the compiled one
    (models/loss.py). First the output is checked against the forward's contract (`what`: the
    model, as the launcher names it): a forward the meta device could not run before the start
    (a value read out with .item()) is checked here, and a tuple or an object instead of the
    logits stops every rank with the contract's message (ForwardContract, exit 2), not with an
    AttributeError of the loss."""
    if dims.tp_enabled:
        tp_group, tp = mesh["tp"].get_group(), dims.tp

        def loss(logits, target):
            if vocab_size is not None and logits.shape[-1] != vocab_size // tp:
                raise ForwardContract(
                    f"{what}: its logits are {logits.shape[-1]} wide on each of parallel.tp={tp} "
                    f"ranks; the loss reads them as 1/{tp} of the vocabulary (model.vocab_size="
                    f"{vocab_size}: {vocab_size // tp} each): plan the module that makes them "
                    "\"vocab_head\" in tensor_parallel_plan()")
            return vocab_parallel_cross_entropy(logits, target, tp_group)
    else:
        loss = compiled_cross_entropy() if compiled else cross_entropy

    def checked(logits, target):
        wrong = output_problem(logits, target.shape, None if dims.tp_enabled else vocab_size)
        if wrong:
            raise ForwardContract(f"{what}: {wrong}")
        return loss(logits, target)
    return checked


def global_mean(value: torch.Tensor, dims: ParallelDims, mesh) -> float:
    """A per-rank mean loss -> the mean over the global batch: summed over pp (only the last
    stage holds a loss), averaged over dp x cp (cp ranks hold equal shares of the same
    sequences; tp ranks already agree)."""
    if dims.pp_enabled:
        dist.all_reduce(value, group=mesh["pp"].get_group())
    if dims.dp_cp > 1:
        dist.all_reduce(value, group=flattened(mesh, "dp_cp").get_group())
        value = value / dims.dp_cp
    return value.item()


def forward_backward(backend: DataParallelBackend, micro, loss_fn, dims: ParallelDims, device,
                     autocast, tracer=None, train: bool = True) -> torch.Tensor:
    """This rank's mean loss over its micro-batches, with gradients accumulated when `train`."""
    if dims.pp_enabled:
        return backend.module.run(micro, loss_fn, autocast, train=train)
    tracer = tracer or Tracer(False)
    loss_sum = torch.zeros((), device=device)
    for i, (x, y, *documents) in enumerate(micro):
        last = i == len(micro) - 1
        kwargs = {"documents": documents[0]} if documents else {}
        with backend.no_sync(last or not train):
            with tracer.span(f"F{i}", "compute"), torch.set_grad_enabled(train), autocast:
                loss = loss_fn(backend.model(x.to(device), **kwargs), y.to(device)) / len(micro)
            if train:
                with tracer.span(f"B{i}", "compute"):
                    backend.backward(loss)
        loss_sum += loss.detach()
    return loss_sum


def train_step(backend: DataParallelBackend, micro, loss_fn, dims: ParallelDims, mesh, device,
               autocast, tracer, before_update=lambda: None) -> tuple[float, Update]:
    """One optimizer step over this rank's micro-batches; (global mean loss, the backend's
    Update: grad norm before clipping, whether it was applied). `before_update` runs after
    backward, before the parameters change. A non-finite loss (every rank knows the global one)
    or gradient norm leaves the parameters and the optimizer's state as they were."""
    loss = forward_backward(backend, micro, loss_fn, dims, device, autocast, tracer)
    pipeline = backend.module if dims.pp_enabled else None
    if pipeline is not None and pipeline.tied is not None:
        # Tied embeddings: the first stage's embedding and the last stage's head are copies of
        # one weight, each holding part of its gradient; both get the sum (before DeepSpeed's
        # dp reduction under ZeRO-1, which reduces p.grad at step()).
        with tracer.span("gradients: tied embedding", "comm"):
            pipeline.all_reduce_tied_grads()
    before_update()
    loss_value = global_mean(loss, dims, mesh)
    finite = all_finite(loss_value, device)
    return (loss_value if finite else math.nan), backend.step(tracer, finite)


def all_finite(value: float, device) -> bool:
    """Whether `value` is finite on every rank: ranks that should agree on the loss (tp ranks,
    whose vocabulary shards each compute it) decide together even if one of them does not."""
    if not dist.is_initialized():
        return math.isfinite(value)
    flag = torch.tensor([float(math.isfinite(value))], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def micro_batches(sampler, step: int, cfg, dims: ParallelDims, coords: dict) -> list:
    """This rank's micro-batches of global batch `step`, whose rows `sampler` chose (sampler.py):
    its dp slice, and its cp shard of each sequence under context parallelism; with
    train.document_masking, each row's document ids too."""
    micro = sampler_micro_batches(sampler, step, micro_batch_size=cfg.train.micro_batch_size,
                                  dp=dims.dp, dp_rank=coords["dp"],
                                  documents=cfg.train.document_masking)
    if dims.cp_enabled:
        micro = shard_batch(micro, dims.cp, coords["cp"])
    return micro


def evaluate(backend: DataParallelBackend, batches, loss_fn, cfg, dims: ParallelDims, mesh,
             coords: dict, device, autocast) -> float:
    """Mean loss over `eval_batches` fixed global batches of the validation split(s)."""
    t = cfg.train
    backend.model.eval()
    total = torch.zeros((), device=device)
    for i in range(t.eval_batches):
        micro = micro_batches(batches.val, i, cfg, dims, coords)
        total += forward_backward(backend, micro, loss_fn, dims, device, autocast, train=False)
    backend.model.train()
    backend.after_evaluation()
    return global_mean(total / t.eval_batches, dims, mesh)
