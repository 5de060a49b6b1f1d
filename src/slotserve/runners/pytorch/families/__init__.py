"""Model families: one file each, listed once in ``registry.py``."""
