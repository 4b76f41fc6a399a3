"""Shared test setup: one thread per process (2 cores, several gloo ranks)."""

import torch

torch.set_num_threads(1)
