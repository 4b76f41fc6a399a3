"""Test-facing fault injection: `NFAB_FAULT="KIND@step=K[,rank=R][,attempt=A][,key=value...];..."`.

Syntax: one or more faults separated by `;`, each `KIND@key=value,key=value`.
Keys: `step` (required, the 0-based optimizer step at whose start the fault fires),
`rank` (global rank; default 0, for `spike` every rank), `attempt` (torchrun attempt
it fires on, i.e. the value of TORCHELASTIC_RESTART_COUNT, default 0: a restarted run
does not repeat it), and the kind's own keys below. Unknown keys are errors.

Kinds:
- `crash` — `os._exit(1)` on that rank, no cleanup (a killed process).
- `nan`, `inf` — that rank's loss is multiplied by NaN / +Inf before backward, so
  every gradient it contributes is non-finite.
- `spike,factor=F[,steps=N]` — the loss on every rank (or only `rank=R`) is
  multiplied by F (> 0) for N steps (default 1), a real spike the health monitor sees.
- `slow,seconds=S` — that rank sleeps S seconds at the start of the step.
- `hang` — that rank sleeps forever: its peers hit the process-group timeout
  (`launch.timeout_s`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from nfab.errors import ConfigError

ENV = "NFAB_FAULT"
KINDS = ("crash", "nan", "inf", "spike", "slow", "hang")
_PARAMS = {"spike": {"factor": True, "steps": False}, "slow": {"seconds": True}}  # key -> required


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault: what, at which step, on which rank (None: every rank) and attempt."""

    kind: str
    step: int
    rank: int | None = 0
    attempt: int = 0
    params: dict[str, str] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        """How many consecutive steps the fault lasts (only `spike` lasts more than one)."""
        return int(self.params.get("steps", "1"))

    def fires(self, step: int, rank: int, attempt: int) -> bool:
        return (self.step <= step < self.step + self.steps and self.rank in (None, rank)
                and self.attempt == attempt)


def _number(item: str, key: str, value: str, kind: type) -> None:
    try:
        ok = kind(value) > 0
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"{ENV}: {item!r}: {key} must be a positive {kind.__name__}, got {value!r}")


def parse_faults(text: str | None) -> tuple[Fault, ...]:
    """Parse an NFAB_FAULT value (empty or None: no faults); bad syntax is a ConfigError."""
    faults = []
    for item in filter(None, (s.strip() for s in (text or "").split(";"))):
        kind, sep, rest = item.partition("@")
        kind = kind.strip()
        if not sep or kind not in KINDS:
            raise ConfigError(f"{ENV}: {item!r} must look like KIND@step=K[,rank=R] with KIND in {KINDS}")
        fields: dict[str, str] = {}
        for pair in filter(None, rest.split(",")):
            key, eq, value = pair.partition("=")
            if not eq:
                raise ConfigError(f"{ENV}: {pair!r} in {item!r} must be key=value")
            fields[key.strip()] = value.strip()
        try:
            step = int(fields.pop("step"))
            rank = int(fields.pop("rank")) if "rank" in fields else (None if kind == "spike" else 0)
            attempt = int(fields.pop("attempt", "0"))
        except KeyError as exc:
            raise ConfigError(f"{ENV}: {item!r} needs step=K") from exc
        except ValueError as exc:
            raise ConfigError(f"{ENV}: {item!r}: step, rank and attempt must be integers") from exc
        allowed = _PARAMS.get(kind, {})
        unknown = sorted(set(fields) - set(allowed))
        if unknown:
            raise ConfigError(f"{ENV}: {item!r}: unknown key(s) {', '.join(unknown)} for {kind} "
                              f"(keys: step, rank, attempt{''.join(', ' + k for k in allowed)})")
        for key, required in allowed.items():
            if key not in fields:
                if required:
                    raise ConfigError(f"{ENV}: {item!r} needs {key}=VALUE")
                continue
            _number(item, key, fields[key], int if key == "steps" else float)
        faults.append(Fault(kind, step, rank, attempt, fields))
    return tuple(faults)


def faults_from_env() -> tuple[Fault, ...]:
    return parse_faults(os.environ.get(ENV))


def restart_attempt() -> int:
    """torchrun's restart count for this worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def inject(faults: tuple[Fault, ...], step: int, rank: int) -> None:
    """Fire every process fault (`crash`, `slow`, `hang`) due at the start of `step` on `rank`."""
    attempt = restart_attempt()
    for f in faults:
        if not f.fires(step, rank, attempt):
            continue
        if f.kind == "crash":
            os._exit(1)
        elif f.kind == "slow":
            time.sleep(float(f.params["seconds"]))
        elif f.kind == "hang":
            while True:  # a rank that never arrives; its peers' collectives time out
                time.sleep(60)


def loss_factor(faults: tuple[Fault, ...], step: int, rank: int) -> float | None:
    """What to multiply this rank's loss by at `step` (`nan`, `inf`, `spike`), or None."""
    attempt = restart_attempt()
    factor = None
    for f in faults:
        if f.fires(step, rank, attempt) and f.kind in ("nan", "inf", "spike"):
            value = float(f.params["factor"]) if f.kind == "spike" else float(f.kind)  # float("nan"), float("inf")
            factor = value if factor is None else factor * value
    return factor
