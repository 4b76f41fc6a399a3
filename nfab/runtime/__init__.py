"""The DDP hook and its state: see `nfab.runtime.frontends.ddp` for how the parts fit together."""
