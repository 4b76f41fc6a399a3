"""Held-out user projects, written the way their users write them, outside `nfab/`: each its own model, data, loss,
and nfab calibrates and trains them through the user-facing contract only (`--data`, `--loss`,
`nfab.calibrate`, `nfab.attach`). `files.py` writes their data in the real file formats."""
