"""nfab report: run and calibration artifacts as terminal tables, summary.csv, and an
HTML page with PNG plots. `build_report` is the entry point; the CLI only prints."""

from nfab.report.build import build_report
from nfab.report.model import Report

__all__ = ["Report", "build_report"]
