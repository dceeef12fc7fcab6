"""Tensor parallelism inside the model: the rank's group and collectives (group.py), which part of
each weight a rank holds (sharding.py), and the vocabulary-parallel embedding and head (vocab.py)."""
