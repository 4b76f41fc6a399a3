"""The DDP hook and its state: see `nfab.runtime.hook` for how the parts fit together."""
