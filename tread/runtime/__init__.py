"""What keeps a run alive on a cluster: the run-dir lock, collective timeouts naming a lost rank, preemption and
requeue, SLURM tasks as ranks, the run dir between launches and the conversion of old pickle checkpoints.
It imports only tread.utils; docs/reliability.md describes each guarantee.
"""
