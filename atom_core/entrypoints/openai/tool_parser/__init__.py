"""Tool-call parsing: the format contract (base) and the one stream reader over it."""
