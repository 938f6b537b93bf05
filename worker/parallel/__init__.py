"""Tensor parallel: a worker group of N ranks (group.py), their slices (shard.py), rank 0
driving the others (driver.py), the followers' entry (follower.py)."""
