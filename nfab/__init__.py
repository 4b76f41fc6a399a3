"""nfab (NEURON-Fabric): controlled low-bit gradient communication for PyTorch DDP."""

__version__ = "0.1.0"
