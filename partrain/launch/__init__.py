"""Start the workers: torch's elastic agent on this node (c10d rendezvous across nodes)."""

from partrain.launch.local import ElasticLaunch, launch_workers
from partrain.launch.rundir import default_run_dir, write_run_dir

__all__ = ["ElasticLaunch", "launch_workers", "default_run_dir", "write_run_dir"]
