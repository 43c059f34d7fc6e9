"""screener: node burn-in and known-answer screening against silent data corruption on GPU clusters.

Importing the package loads nothing heavy; `screener.fingerprint` and `screener.audit` load only torch
and the standard library, so a training job pays for nothing else.
"""

__version__ = "0.1.0"
