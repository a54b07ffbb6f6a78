"""Start the workers on this node and across nodes (torch's elastic agent, c10d rendezvous,
SLURM), with every check before a start; no training math. Starts `partrain.train` by module name
and never imports it.

The flow: start.py holds the bodies of `partrain launch` and `partrain slurm`; each runs
preflight.py (every check, in one order) and then writes the run dir (rundir.py) and either runs
this node's ranks under the elastic agent (local.py, with cluster.py, netif.py, lifeline.py and
preemption.py) or writes and submits the sbatch script (slurm.py; its values checked by
sbatch_checks.py)."""
