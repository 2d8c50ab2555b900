"""Parallelism on torch.distributed: the process groups (``state``) and the collectives the
layers call (``collectives``)."""
