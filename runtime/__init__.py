"""The distributed runtime: rank partitions, the control channel, and the workers behind the controller."""
