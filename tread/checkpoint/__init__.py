"""Checkpoints: the directory layout and its files (single and sharded), the training state they hold, writing
them, resuming from them with every value checked, and converting earlier versions' and the other layout's."""
