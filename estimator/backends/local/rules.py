"""A local job's Estimator rules: its files stay on this machine (no S3)."""

from estimator.backends.supervised.rules import JobDirRules

RULES = JobDirRules()
