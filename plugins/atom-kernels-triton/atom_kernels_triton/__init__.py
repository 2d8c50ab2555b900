"""Triton kernels for CUDA/ROCm GPUs as ATOM ops and attention backends (priority 10, above
the core's torch reference).

Every kernel also runs on CPU tensors under ``TRITON_INTERPRET=1`` (this plugin's tests), so
it is checked against the core's reference without a GPU.
"""
