"""One worker, read top to bottom. The elastic agent starts `python -m partrain.train RUN_DIR` once
per rank (__main__.py: the lifeline and the preemption signal first, then loop.main):

1. loop.main: this rank's log file, the device, the process group, RUN_DIR/config.yaml through
   config.frozen (the launcher's own loader; never Hydra).
2. assemble.build -> Run: the mesh, where to start (the newest checkpoint, model.init_from, or
   the seed), the full model, parallel.parallelize (the one place the wrappers' order is
   written, ending in the data-parallel backend: DDP or ZeRO), the optimizer (optim), data,
   metrics and the checkpointer; cross-cutting work (the MoE router accounting) attaches here.
3. loop.train: for each step, step.train_step (forward/backward over the micro-batches, then the
   backend's reduce, clip and optimizer step), a metrics line, evaluation and checkpoints on
   their cadence, a save and a stop on a preemption signal; then the trace and the summary.

To run one rank by hand (a debugger on rank 0 of a 1-process run):
`partrain launch --dry-run ...` checks a config, and `RANK=0 LOCAL_RANK=0 WORLD_SIZE=1
MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python -m partrain.train RUN_DIR` runs the worker of a
run dir that `partrain launch` wrote.
"""
