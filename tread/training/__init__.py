"""The training loop as importable pieces: set-up (setup.py), the one training step (step.py), the resume
state (state.py) and its checkpoints (checkpoint.py), the loop itself (loop.py), EMA, run records and
the run summary. train.py calls tread.training.loop.train; the benchmark and the route planner time step.TrainStep."""
