"""AMD ROCm kernels (aiter) as ATOM ops; declines on machines without ROCm and aiter."""
