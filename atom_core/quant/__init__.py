"""Quantized formats and their reference ops (``fp8``)."""
