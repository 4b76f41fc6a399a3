"""The control: controller (routes), control word, health, fidelity probes, optimizer-aware moment."""
