"""``smsdp probe``'s measurements of compute, and the run that puts them beside the collectives'.

``compute.py`` (matmuls, transformer blocks), ``optimizer.py`` (AdamW, clip + AdamW per tensor,
plain and DTensor), ``codec.py`` (the int8 block codec); the collectives are timed in
``smsdp/comm/link_probe.py``; ``run.py`` runs them all and makes the calibration dict that
``smsdp.planner.calibration.Rates`` reads. Torch, on every rank of a job.
"""
