"""Imported once by the rank server (tests/conftest.py), so that no forked rank pays it again:
numba's registries and the fp32 sign kernel, loaded from numba's cache. Never fails the server."""

import torch

try:
    from nfab.wire.sign import host as sign_host

    sign_host.sign_votes(torch.ones(64), [64])
except Exception:  # noqa: BLE001 - a warm-up only: a rank loads what it needs itself
    pass
