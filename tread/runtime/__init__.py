"""What keeps a run alive on a cluster: the run-dir lock (lock.py) over this host's process table
(processes.py), collective timeouts that name a stopped or lost rank (collectives.py), preemption and
requeue (preempt.py), SLURM tasks as ranks (slurm.py), the run dir between launches (run_dir.py) and the
conversion of old pickle checkpoints (legacy.py). It imports only tread.utils; training builds on it.
docs/reliability.md describes each guarantee and the test that pins it."""
