"""nfab in the classic `pytorch_lightning` namespace: the same strategy as `nfab.integrations.lightning`.

    import pytorch_lightning as pl
    from nfab.integrations.pytorch_lightning import NfabDDPStrategy
    trainer = pl.Trainer(strategy=NfabDDPStrategy(route="sign"), accelerator="cpu", devices=2)

`pytorch_lightning.Trainer` refuses a strategy built on `lightning.pytorch` ("You selected an
invalid strategy name"), so this module builds nfab's strategy on `pytorch_lightning`'s own
`DDPStrategy` (`nfab.integrations.lightning_strategy`). `calibrate` is the same function as
`nfab.integrations.lightning.calibrate` (`nfab.integrations.lightning_calibrate`).
"""

from __future__ import annotations

try:
    from pytorch_lightning.strategies import DDPStrategy
except ImportError as e:  # pragma: no cover - exercised only without the package
    raise ImportError("nfab.integrations.pytorch_lightning needs pytorch_lightning: pip install pytorch-lightning "
                      "(with the lightning package, use nfab.integrations.lightning)") from e

from nfab.integrations.lightning_calibrate import calibrate
from nfab.integrations.lightning_strategy import ddp_strategy_class

NfabDDPStrategy = ddp_strategy_class(DDPStrategy, __name__)

__all__ = ["NfabDDPStrategy", "calibrate"]
