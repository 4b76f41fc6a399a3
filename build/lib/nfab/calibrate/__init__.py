"""Calibration: measure where low-bit aggregation is safe, then fit an operating profile.

`run_sweep` fills the calibration table (FP32 reference run, reducer-side replay of W
virtual ranks, short trials from phase checkpoints); `fit_profile` is the pure function
from that table and tolerances to a `Profile`.
"""

from nfab.calibrate.config import CalibrationConfig, make_config, parse_overrides
from nfab.calibrate.fit import TOL_COSINE, TOL_LOSS, fit_profile
from nfab.calibrate.replay import reduce_virtual
from nfab.calibrate.sweep import calibrate, fit_file, run_sweep
from nfab.calibrate.table import read_table, write_table

__all__ = [
    "TOL_COSINE",
    "TOL_LOSS",
    "CalibrationConfig",
    "calibrate",
    "fit_file",
    "fit_profile",
    "make_config",
    "parse_overrides",
    "read_table",
    "reduce_virtual",
    "run_sweep",
    "write_table",
]
