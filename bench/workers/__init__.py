"""What the benchmarks start on every rank (``python -m bench.workers.NAME`` under mpirun or in a
namespaced host)."""
