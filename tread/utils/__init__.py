"""Small helpers every package may import: user errors, process ranks and gathers, atomic file writes,
device choice and the checkpoint directory layout. Nothing here imports the rest of the project."""
