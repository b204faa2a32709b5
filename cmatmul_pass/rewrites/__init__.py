"""Rewrites: one module per site kind, sharing the loop and op builders in ``builders``."""
