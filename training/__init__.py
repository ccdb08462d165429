"""The training loop, EMA, checkpoints, metrics and evaluation as importable functions."""
