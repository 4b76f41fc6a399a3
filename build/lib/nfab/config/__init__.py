"""Typed configuration shared by `nfab train` and `nfab calibrate` (below both layers)."""
