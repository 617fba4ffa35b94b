"""The benchmarks: smsdp against what users would pick instead, each run as ``python -m bench.NAME``
from the repository root (bench/README.md lists them and what they print)."""
