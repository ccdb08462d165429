"""Speed and cost: the throughput benchmark of the training step, memory and MFU, and the route planner."""
