"""Measurements made with probes: gradient numerics, localisation, the data scan, precision comparisons,
and the symptom definitions and thresholds they are judged by."""
