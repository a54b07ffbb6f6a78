"""Pipeline parallelism (parallel.pp): the model cut into stages along the "pp" mesh dimension, each
optimizer step run as micro-batches through a schedule.

`apply_pipeline_parallel` takes the (possibly tensor-parallel) full model and keeps this rank's
chunks: stage s = chunk * pp + pp_rank owns a run of consecutive blocks (balanced by count, or
`parallel.pp_layers`), the first stage also the embedding, the last the final norm, the head and
the loss.

Tied embeddings (the head's weight is the embedding's) put one weight on two stages: the embedding
on the first chunk of pp rank 0, the head on the last chunk of rank pp-1. Each keeps a copy, equal
at the start (every rank builds the same full model); after backward `all_reduce_tied_grads` sums
the two copies' gradients over the embedding group (those two ranks, at the same dp and tp
coordinates: Megatron's embedding group), so both take the same step and stay equal. The head's
copy carries `tied_to` (the embedding's name): checkpoints save it under that name, and the
gradient norm counts the weight once, on the first stage.

`PipelineModel.run` executes this rank's program (partrain.parallel.schedules.build_program) for
its action list: compute F/B; post each run of sends together with the receives that come next
(batch_isend_irecv); wait for a receive just before the compute that needs it; release a send (wait
on it and drop its buffer) once the schedule proves the peer has posted its receive. On gloo, which
moves a message only once its receive is posted, receives are posted one compute ahead, so the
transfer overlaps that compute instead of waiting in line with it (scripts/bench_pp.py: the
executor and its transfers add at most about 0.015 to the bubble on 2 CPU ranks). On NCCL the
program keeps the schedule's order: its transfers run on their own stream while the CPU runs
ahead, and one rank's sends and receives to a peer share that stream in order, which an early
receive could block. Messages carry a tag naming (direction, stage, micro-batch) for gloo; NCCL
ignores tags and matches in order, which the schedules also satisfy (sends from a to b in the
order b receives them; a unit test checks it). Each micro-batch's loss is scaled by
1/micro_batches, so the accumulated gradient is that of the mean loss, as without pp.

Every compute and communication span goes to the tracer (partrain.observe.trace), if one is recording.
"""

import torch
import torch.distributed as dist
from torch import nn

from partrain.models.arith import stage_layers
from partrain.observe.trace import Tracer
from partrain.parallel.dist import local
from partrain.parallel.schedules import (
    COMPUTE_STEP,
    POST,
    Step,
    build_program,
    build_schedule,
    message_key,
)


class PipelineModel(nn.Module):
    """This rank's chunks of the model and the executor of its schedule."""

    def __init__(self, chunks: list[nn.Module], group, schedule: str, activation_shape,
                 tracer: Tracer | None = None, tied: nn.Parameter | None = None,
                 embedding_group=None):
        super().__init__()
        # A tuple, not an attribute holding the Parameter: that would register it under a
        # second name beside the chunk's own.
        self._tied, self.embedding_group = (tied,) if tied is not None else (), embedding_group
        self.chunks = nn.ModuleList(chunks)
        self.group, self.schedule = group, schedule
        self.pp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.peers = [dist.get_global_rank(group, r) for r in range(self.pp)]
        self.last_stage = self.pp * len(chunks) - 1
        self.activation_shape = tuple(activation_shape)
        self.tracer = tracer or Tracer(False)
        # Receives posted a compute ahead on gloo, whose transfers wait for the receive; NCCL's
        # run on their own stream while the CPU runs ahead, so they are posted in place.
        self.early = dist.get_backend(group) == "gloo"
        self._plans: dict[tuple[int, bool], list[Step]] = {}
        # Called after the schedule's last backward (FSDP: its one gradient reduction a step).
        self.finish_backward = None

    def _as_input(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        """A received activation (sent as fp32) in the dtype of the chunk's weights: DeepSpeed's
        ZeRO keeps them in bf16 and runs no autocast, and a bf16 ZeRO-1 run with pp failed at the
        second stage's first matmul (float != BFloat16). The cast is differentiable: the
        gradient sent back is x's, fp32. Under autocast or FSDP (fp32 shards) it is x itself."""
        dtype = next((p.dtype for p in self.chunks[chunk].parameters()
                      if p.is_floating_point()), x.dtype)
        return x if x.dtype == dtype else x.to(dtype)

    def retie(self) -> None:
        """Point at this rank's copy of the tied embedding again, after a wrapper (FSDP)
        replaced the chunks' parameters."""
        if self._tied:
            first = self.chunks[0].tok_embeddings
            self._tied = (first.weight if first is not None else self.chunks[-1].output.weight,)
    @property
    def tied(self) -> nn.Parameter | None:
        """This rank's copy of the tied embedding (first and last pp ranks), else None."""
        return self._tied[0] if self._tied else None

    def all_reduce_tied_grads(self) -> None:
        """Sum the tied embedding's gradient over its two copies (first and last stage), after
        backward and before the gradient norm and the optimizer step; nothing elsewhere."""
        if self.tied is not None and self.tied.grad is not None:
            dist.all_reduce(local(self.tied.grad), group=self.embedding_group)

    def _program(self, m: int, train: bool) -> list[Step]:
        if (m, train) not in self._plans:
            ranks = build_schedule(self.schedule, self.pp, m, len(self.chunks))
            if not train:
                # Forward only (evaluation): the same order without backwards cannot deadlock,
                # since forward messages only flow to later stages.
                ranks = [[a for a in actions if a.op in ("F", "RECV_F", "SEND_F")]
                         for actions in ranks]
            self._plans[(m, train)] = build_program(ranks, early=self.early)[self.rank]
        return self._plans[(m, train)]

    def _tag(self, action) -> int:
        direction, stage, mb = message_key(action, self.rank, self.pp)
        return (stage * 2 + (direction == "B")) * 100_000 + mb

    def _post(self, batch, device, outputs, inputs, posted, train) -> None:
        """Post sends and receives together (batch_isend_irecv: one NCCL group, so a send and a
        receive between the same two ranks cannot wait on each other). gloo gives a work per
        operation, kept until its wait or release step; NCCL one for the group, waited on here
        (a stream wait: the CPU goes on)."""
        ops = []
        for a in batch:
            key = (a.chunk, a.mb)
            if a.op == "SEND_F":
                out = outputs[key] if train else outputs.pop(key)
                tensor = out.detach().float().contiguous()
            elif a.op == "SEND_B":
                tensor = inputs.pop(key).grad.float().contiguous()
            else:
                tensor = torch.empty(self.activation_shape, device=device)
            op = dist.isend if a.op.startswith("SEND") else dist.irecv
            ops.append(dist.P2POp(op, tensor, self.peers[a.peer], tag=self._tag(a)))
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # coalesced (NCCL): the group completes as one
            for work in works:
                work.wait()
            works = [None] * len(ops)
        for a, op, work in zip(batch, ops, works):
            posted[(a.op, a.chunk, a.mb)] = (work, op.tensor)

    def run(self, micro, loss_fn, autocast, train: bool = True) -> torch.Tensor:
        """One pass of the schedule over this dp rank's micro-batches [(tokens, targets) or
        (tokens, targets, document ids)];
        backward too when `train`. Returns the mean loss over micro-batches on the last
        stage's ranks, zero elsewhere."""
        m = len(micro)
        device = next(self.parameters()).device
        total = torch.zeros((), device=device)
        inputs, outputs, grads, losses, posted = {}, {}, {}, {}, {}
        for step in self._program(m, train):
            if step.kind != COMPUTE_STEP:
                with self.tracer.span(f"{step.kind} " + " ".join(
                        f"{a.op.lower()} {a.chunk}.{a.mb}" for a in step.actions), "comm"):
                    if step.kind == POST:
                        self._post(step.actions, device, outputs, inputs, posted, train)
                        continue
                    for a in step.actions:  # wait for receives, or release sends
                        work, tensor = posted.pop((a.op, a.chunk, a.mb))
                        if work is not None:
                            # Read by the hang watch (observe/hang.py) if this wait never ends.
                            way = "to" if a.op.startswith("SEND") else "from"
                            waiting_for = (f"{a.op.lower()} of micro-batch {a.mb} (chunk "
                                           f"{a.chunk}) {way} rank {self.peers[a.peer]}")
                            work.wait()
                            del waiting_for
                        if a.op == "RECV_F":
                            inputs[(a.chunk, a.mb)] = tensor.requires_grad_(train)
                        elif a.op == "RECV_B":
                            grads[(a.chunk, a.mb)] = tensor
                continue
            a = step.actions[0]
            stage, key = a.chunk * self.pp + self.rank, (a.chunk, a.mb)
            with self.tracer.span(f"{a.op}{a.chunk}.{a.mb}", "compute"):
                if a.op == "F":
                    tokens, targets, *documents = micro[a.mb]
                    x = tokens.to(device) if stage == 0 else self._as_input(a.chunk,
                                                                             inputs[key])
                    # Every stage masks its attention by the micro-batch's documents.
                    kwargs = {"documents": documents[0]} if documents else {}
                    with torch.set_grad_enabled(train), autocast:
                        out = self.chunks[a.chunk](x, **kwargs)
                        if stage == self.last_stage:
                            loss = loss_fn(out, targets.to(device)) / m
                            total += loss.detach()
                            if train:
                                losses[key] = loss
                        else:
                            outputs[key] = out
                    if not train:
                        inputs.pop(key, None)
                elif stage == self.last_stage:
                    losses.pop(key).backward()
                else:
                    out = outputs.pop(key)
                    torch.autograd.backward(out, grads.pop(key).to(out.dtype))
        if train and self.finish_backward is not None:
            with self.tracer.span("gradients: FSDP reduce-scatter", "comm"):
                self.finish_backward()
        return total


def apply_pipeline_parallel(model: nn.Module, pp_mesh, cfg, activation_shape,
                            tracer: Tracer | None = None) -> PipelineModel:
    """Keep this pp rank's chunks of `model` (cfg: the `parallel` section: pp_schedule,
    pp_virtual_stages, pp_layers); activation_shape is what flows between stages:
    (micro_batch_size, seq_len, or seq_len / tp under sequence parallelism, dim)."""
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    v = cfg.pp_virtual_stages
    layers = stage_layers(len(model.layers), pp, v, cfg.get("pp_layers"))
    last = pp * v - 1
    chunks = [model.pipeline_chunk(layers[c * pp + rank], first=c * pp + rank == 0,
                                   last=c * pp + rank == last) for c in range(v)]
    tied, embedding_group = None, None
    head, embedding = getattr(model, "output", None), getattr(model, "tok_embeddings", None)
    if head is not None and embedding is not None and head.weight is embedding.weight and pp > 1:
        tied, embedding_group = _tied_copy(chunks, pp_mesh)
    return PipelineModel(chunks, pp_mesh.get_group(), cfg.pp_schedule, activation_shape, tracer,
                         tied, embedding_group)


def _tied_copy(chunks: list[nn.Module], pp_mesh):
    """(this rank's copy of the tied embedding, the embedding group) on the first and last pp
    ranks; (None, None) on the others. Only the two members create the group (no other rank
    calls new_group), so pp groups at other dp/tp coordinates create theirs independently."""
    group = pp_mesh.get_group()
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    if rank not in (0, pp - 1):
        return None, None
    if rank == 0:
        tied = chunks[0].tok_embeddings.weight
    else:
        tied = chunks[-1].output.weight
        tied.tied_to = "tok_embeddings.weight"
    if pp > 2:
        ends = [dist.get_global_rank(group, 0), dist.get_global_rank(group, pp - 1)]
        group = dist.new_group(ends, use_local_synchronization=True)
    return tied, group
