"""Front ends: how a framework's reduction call reaches the reduction core (DDP's GradBucket hook,
FSDP2's reduce-scatter)."""
