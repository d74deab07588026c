"""lcsm: linear-complexity sequence models as one Expand-Oscillation-Shrink operator."""

__version__ = "0.1.0"
