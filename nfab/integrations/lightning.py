"""nfab in Lightning (`lightning.pytorch`): a `DDPStrategy` attaching nfab's hook on any device, CPU/gloo included.

    import lightning as L
    from nfab.integrations.lightning import NfabDDPStrategy
    trainer = L.Trainer(strategy=NfabDDPStrategy(route="sign"), accelerator="cpu", devices=2)

A Trainer accepts only its own namespace's strategies: with the classic `pytorch_lightning`
import `NfabDDPStrategy` from `nfab.integrations.pytorch_lightning` instead (the same class,
built on that namespace's `DDPStrategy`; see `nfab.integrations.lightning_strategy`).

`calibrate(module, datamodule, out=...)` calibrates the training `fit` would run and writes the
profile the strategy takes (`nfab.integrations.lightning_calibrate`; both namespaces export it).
"""

from __future__ import annotations

try:
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("nfab.integrations.lightning needs Lightning: pip install 'nfab[lightning]' "
                      "(with the classic pytorch_lightning, use nfab.integrations.pytorch_lightning)") from e

from nfab.integrations.lightning_calibrate import calibrate
from nfab.integrations.lightning_strategy import ddp_strategy_class

NfabDDPStrategy = ddp_strategy_class(DDPStrategy, __name__)

__all__ = ["NfabDDPStrategy", "calibrate"]
