"""The hook runtime: bindings, bucket plans, control words, health and the DDP hook."""
