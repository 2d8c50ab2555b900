"""The serving benchmark client (``atom bench serve``) and its test double."""
