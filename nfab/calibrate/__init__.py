"""Calibration: measure where low-bit aggregation is safe, then fit an operating profile.

`run_sweep` fills the calibration table (FP32 reference run, reducer-side replay of W
virtual ranks, short trials from phase checkpoints); `fit_profile` is the pure function
from that table and tolerances to a `Profile`.

The package is itself callable: `nfab.calibrate(model, data, loss=...)` is `nfab.calibrate.api.calibrate`,
the Python API for the user's own training (a package and a function cannot share the name `nfab.calibrate`
otherwise: importing the package would shadow the function on `nfab`).
"""

import sys
import types
from typing import Any

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


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from nfab.calibrate.api import calibrate as calibrate_user

        return calibrate_user(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
