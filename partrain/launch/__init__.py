"""Start the workers on this node and across nodes (torch's elastic agent, c10d rendezvous,
SLURM), with every check before a start; no training math. Starts `partrain.train` by module name
and never imports it."""
