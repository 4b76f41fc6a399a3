"""One results file per benchmark setting: repeated runs inside it, with min / median / max.

`nfab bench step|wire|tta --json RUN.json` writes one run; fold it into its setting's file with

    python -m bench.runs bench/step/100mbit-w32.json RUN.json [RUN.json ...]

The file holds every run as written (`runs`, each with the file it came from) and, per variant
(step) or reducer and W (wire; `/torch`, `/compiled` for the torch paths), the min, median and
max of each number over the runs (`summary`), so a table can quote the spread and never a hand-picked run.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

SCHEMA = "nfab.bench.runs"
STEP_KEYS = ("median_ms", "ratio_to_floor", "ratio_to_plain", "hook_ms_median", "wire_bytes_per_step",
             "measured_wire_bytes_per_step", "modelled_wire_bytes_per_step")
WIRE_KEYS = ("ratio_to_copy", "encode_decode_gbps", "copy_gbps", "bits_per_element")
TTA_KEYS = ("time_to_target_s", "steps_to_target", "final_loss", "wire_bytes", "speedup_vs_fp32", "speedup_vs_bf16",
            "speedup_vs_bf16_at_least")


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def _rows(run: Any) -> list[tuple[str, dict[str, Any]]]:
    """(key, row) per row of one run: `nfab bench step` and `nfab bench tta` rows by variant, `nfab bench wire`
    rows by reducer@W."""
    if isinstance(run, list):  # nfab bench wire (the torch and compiled paths apart from the host kernels)
        return [(f"{r['reducer']}@W={r['world_size']}" + (f"/{r['impl']}" if r.get("impl", "host") != "host" else ""),
                 r) for r in run]
    if "variants" in run:  # nfab bench tta (a variant that never reached the target has no time: left out)
        return list(run["variants"].items())
    nfab = run.get("nfab", {})  # the hook's own numbers per nfab variant (hook_ms_median, bytes)
    bucket = run.get("config", {}).get("nfab_bucket_mb")  # a bucket-size sweep shares its setting's file
    tag = f"@{bucket:g}MB" if isinstance(bucket, (int, float)) else ""
    return [(r["variant"] + tag, {**nfab.get(r["variant"], {}), **r}) for r in run["rows"]]


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per row key and number: its spread over the runs (keys a run lacks are left out)."""
    values: dict[str, dict[str, list[float]]] = {}
    for entry in runs:
        for key, row in _rows(entry["run"]):
            for k in (*STEP_KEYS, *WIRE_KEYS, *TTA_KEYS):
                v = row.get(k)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    values.setdefault(key, {}).setdefault(k, []).append(float(v))
    return {key: {k: _spread(v) for k, v in ks.items()} for key, ks in values.items()}


def fold(path: Path, run_files: list[Path]) -> dict[str, Any]:
    """Add the runs in `run_files` to the setting file at `path` (created if absent); returns the document."""
    doc = json.loads(path.read_text()) if path.is_file() else {"schema": SCHEMA, "version": 1, "runs": []}
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a {SCHEMA} file")
    for f in run_files:
        run = json.loads(f.read_text())
        command = run[0].get("command", "") if isinstance(run, list) and run else (
            run.get("command", "") if isinstance(run, dict) else "")
        doc["runs"].append({"source": f.name, "command": command, "run": run})
    doc["summary"] = summarize(doc["runs"])
    path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    return doc


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m bench.runs SETTING.json RUN.json [RUN.json ...]", file=sys.stderr)
        return 2
    doc = fold(Path(args[0]), [Path(a) for a in args[1:]])
    print(f"{args[0]}: {len(doc['runs'])} runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
