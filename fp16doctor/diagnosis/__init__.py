"""``diagnose``: the ordered triage (stages), the rules, and the ranked diagnosis."""

from .engine import DiagnoseOptions, diagnose, fixed_config, merge_patch, rank
from .model import Diagnosis, Evidence, Finding, Fix, StageReport

__all__ = ["DiagnoseOptions", "Diagnosis", "Evidence", "Finding", "Fix", "StageReport", "diagnose", "fixed_config", "merge_patch", "rank"]
