"""One-line summaries of a calibration's cost and validation, read from the profile's own evidence.

Both read the JSON-safe forms stored in the artifacts (profile.json's `evidence.validation`
and `provenance.timing`), so a report of an old calibration prints the same line the
calibrate command printed.
"""

from __future__ import annotations

from typing import Any

STAGES: tuple[str, ...] = ("reference", "replay", "trials", "validation")
"""The stages the calibration budget is about (ratio = total / reference)."""
SHOWN: tuple[str, ...] = ("setup", *STAGES, "other")
"""Everything the time split shows: setup is building the model and data, other the fit and the files."""


def describe_timing(split: dict[str, Any]) -> str:
    """`total 123 s = 2.95x the FP32 reference (setup 2 s, reference 41 s, ...); CPU 120 s = 2.9x the reference's`."""
    parts = [f"{k} {split.get(f'{k}_s') or 0.0:.1f} s" for k in SHOWN]
    ratio, cpu_ratio = split.get("ratio"), split.get("cpu_ratio")
    head = f"total {split.get('total_s') or 0.0:.0f} s" + (f" = {ratio:.2f}x the FP32 reference" if ratio else "")
    tail = f"; CPU {split.get('cpu_s') or 0.0:.0f} s = {cpu_ratio:.2f}x the reference's" if cpu_ratio else ""
    return f"{head} ({', '.join(parts)}){tail}"


def describe_validation(ev: dict[str, Any]) -> str:
    """`validation over 300 steps: passed, gap +0.41% (tolerance 1.00%) after 2 round(s); tightened ...`
    (a noisy reference, said so first: `_noise_verdict`); a gap under one held-out prediction's worth:
    `(tolerance 1.00%; one held-out prediction moves the loss by 0.0090 nats, so judged at 2.3%)`; a
    calibration shorter than the run it is for:
    `validation over 100 steps of a 300-step run: ...`, what was validated, not the run's length)."""
    if ev.get("passed") is None:
        return f"validation: none ({ev.get('stopped') or 'not run'})"
    gap = ev.get("gap")
    gap_text = "diverged or stopped early" if gap is None else f"gap {gap * 100:+.2f}%"
    rounds = ev.get("rounds") or []
    tolerance = f"tolerance {float(ev.get('tolerance') or 0.0) * 100:.2f}%"
    steps, run = ev.get("steps"), ev.get("run_steps")
    span = f"{steps} steps" if not run or not steps or run <= steps else f"{steps} steps of a {run}-step run"
    if ev.get("judged_by") == "noise":  # the reference moved more than the tolerance: judged against its noise
        return _noise_verdict(ev, span, gap_text, rounds)
    if ev.get("judged_by") == "resolution":  # the tolerance was finer than one held-out prediction
        tolerance += (f"; one held-out prediction moves the loss by {float(ev.get('resolution') or 0.0):.4f} nats, "
                      f"so judged at {float(ev.get('judged_tolerance') or 0.0) * 100:.1f}%")
    text = (f"validation over {span}: {'passed' if ev['passed'] else 'FAILED'}, {gap_text} "
            f"({tolerance}) after {len(rounds)} round(s)")
    return text + _rounds_tail(ev, rounds)


def _rounds_tail(ev: dict[str, Any], rounds: list[Any]) -> str:
    changes = [r["change"] for r in rounds if isinstance(r, dict) and r.get("change")]
    text = "; tightened " + ", ".join(changes) if changes else ""
    return text + (f"; stopped: {ev['stopped']}" if ev.get("stopped") else "")


def _noise_verdict(ev: dict[str, Any], span: str, gap_text: str, rounds: list[Any]) -> str:
    """A verdict judged against FP32's own noise, said so first: `passed` beside a gap of +40% read as
    "passed at +40%" to a newcomer. `validation over 150 steps: passed only within FP32's own noise, not at
    the 1.00% tolerance: gap +34.53%, while FP32's own held-out loss moves 30.5% between evaluations on this
    data, so no gap under 91.6% can be told from noise; after 1 round(s)`."""
    noise = float(ev.get("noise") or 0.0) * 100
    judged = float(ev.get("judged_tolerance") or 0.0) * 100
    tolerance = float(ev.get("tolerance") or 0.0) * 100
    verdict = (f"passed only within FP32's own noise, not at the {tolerance:.2f}% tolerance" if ev["passed"]
               else "FAILED, beyond FP32's own noise")
    return (f"validation over {span}: {verdict}: {gap_text}, while FP32's own "
            f"held-out loss moves {noise:.1f}% between evaluations on this data, so no gap under {judged:.1f}% "
            f"can be told from noise; after {len(rounds)} round(s)" + _rounds_tail(ev, rounds))


def failed_validation(ev: Any) -> str | None:
    """What failed, in one short line, for a profile whose validation failed; None for one that passed,
    was never validated or holds no validation evidence: `validation FAILED over 300 steps: gap +2.41%
    vs tolerance 1.00%` (`... vs tolerance 1.00%, judged at 91.6%` where the reference's noise or the
    held-out resolution widened it; `diverged or stopped early (tolerance 1.00%)` where there is no gap).
    `describe_validation` is the whole story (rounds, what was tightened)."""
    if not isinstance(ev, dict) or ev.get("passed") is not False:
        return None
    gap = ev.get("gap")
    tolerance = float(ev.get("tolerance") or 0.0) * 100
    judged = ev.get("judged_tolerance")
    against = f"tolerance {tolerance:.2f}%"
    if ev.get("judged_by") in ("noise", "resolution") and judged is not None:
        against += f", judged at {float(judged) * 100:.1f}%"
    what = f"diverged or stopped early ({against})" if gap is None else f"gap {gap * 100:+.2f}% vs {against}"
    steps = f" over {ev['steps']} steps" if ev.get("steps") else ""
    return f"validation FAILED{steps}: {what}"

