"""nfab's runtime, by role: two front ends over one reduction core, steered by the control.

- `frontends/`: how a framework's reduction reaches nfab. `ddp.py`: DDP's GradBucket hook (a bucket
  of a flat all-reduce); `fsdp.py`: FSDP2's reduce-scatter (a module's (W, C) rows, one rank's
  row out), with `fsdp_layout.py` reading FSDP2's param groups into row layouts.
- `state.py`: what both front ends give the user (`observe_loss`, `step_stats`, `state_dict`) and
  the state behind it: the controller, the health monitor, the step, the statistics.
- `core/`: one step's reduction. A slice table (`plan.py` for a DDP bucket, `shards.py` for an
  FSDP2 row), encode and launch (`encode.py`, `agreement.py`, `coalesce.py`, `twolevel.py`,
  `rowscatter.py`), decode (`decode.py`) and the step's fold into statistics (`fold.py`).
- `control/`: decisions made from agreed values only: routes (`controller.py`), the control word
  (`word.py`), health and fidelity, the optimizer-aware parts (`optim.py`, `moment.py`).
"""
