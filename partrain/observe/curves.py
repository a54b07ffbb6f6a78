"""Curves: rank 0's metrics records as TensorBoard scalars and W&B history, beside metrics.jsonl.

`train.tensorboard=true` writes event files to RUN_DIR/tensorboard/ (torch's SummaryWriter, which
needs the `tensorboard` package); `train.wandb=offline|online` logs through the `wandb` library
into RUN_DIR/wandb/ (offline: files only, nothing is sent; `wandb sync` uploads them later). Both
libraries are optional extras (`pip install 'partrain[tensorboard]'`, `'partrain[wandb]'`); the
launcher refuses a run that asks for one that is not installed.

A resumed run continues the same curves: the event file of each start marks its first step
(`purge_step`), and W&B reuses the run id kept in RUN_DIR/wandb/run-id. TensorBoard's Python
reader (EventAccumulator: `tensorboard --load_fast=false`, tbparse) drops the earlier start's
events from that step on; its default Rust data server does not, and a tag the resumed run does
not write again (an evaluation at the end of the abandoned part) keeps its stale points there.
"""

import secrets
from pathlib import Path

# metrics.jsonl key -> curve name. Records without any of these (checkpoint lines, the resume
# marker) draw no curve. `epoch` draws data/epoch, or under data.blend data/epoch/K for source K
# of data.blend (its order).
TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr",
        "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s", "mfu": "perf/mfu",
        "memory_gib": "perf/memory_gib", "val_loss": "val/loss"}


def check_curves(cfg) -> None:
    """Refuse (ConfigError, before anything starts) curves whose library is not installed."""
    from importlib.util import find_spec

    from partrain.errors import ConfigError

    t = cfg.train
    asked = {"tensorboard": ("train.tensorboard", t.tensorboard),
             "wandb": ("train.wandb", t.wandb != "off" and t.wandb)}
    for package, (key, value) in asked.items():
        if value and find_spec(package) is None:
            raise ConfigError(f"{key}={str(value).lower()} needs the {package} package, which is "
                              f"not installed: pip install 'partrain[{package}]'")


def _wandb_id(run_dir: Path) -> str:
    """The run's W&B id, made once and kept in the run dir, so that a resume continues it."""
    path = run_dir / "wandb" / "run-id"
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    run_id = secrets.token_hex(4)
    path.write_text(run_id + "\n")
    return run_id


class Curves:
    """The curve sinks of one run (rank 0 only: build it with enabled=False elsewhere)."""

    def __init__(self, run_dir: Path, cfg, first_step: int, enabled: bool):
        self.tensorboard = self.wandb = None
        if not enabled:
            return
        t = cfg.train
        if t.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # At step 1 too: a start again from the first step (no checkpoint yet, an in-job
            # restart, a requeue) must drop the earlier start's points as a resume does.
            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"), purge_step=first_step)
        if t.wandb != "off":
            import wandb
            from omegaconf import OmegaConf

            self.wandb = wandb.init(
                project=t.wandb_project, name=cfg.name, id=_wandb_id(run_dir), resume="allow",
                dir=str(run_dir), mode=t.wandb, config=OmegaConf.to_container(cfg, resolve=True),
                settings=wandb.Settings(console="off", silent=True, disable_git=True,
                                        save_code=False, x_disable_stats=True))

    def write(self, record: dict) -> None:
        scalars = {TAGS[key]: value for key, value in record.items() if key in TAGS}
        epoch = record.get("epoch")  # data.sampling=epochs: a number; data.blend: one a source
        if isinstance(epoch, list):
            scalars.update({f"data/epoch/{k}": value for k, value in enumerate(epoch)})
        elif epoch is not None:
            scalars["data/epoch"] = epoch
        if not scalars:
            return
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
