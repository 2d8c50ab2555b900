"""Tool-call wire formats and reasoning dialects for ATOM (see README.md)."""
