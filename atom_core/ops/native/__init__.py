"""Torch reference implementations of every op: correct everywhere, fast nowhere in particular."""
