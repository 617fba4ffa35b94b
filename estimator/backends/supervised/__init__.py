"""What every backend that runs a job through a supervisor process in a job directory shares.

The local backend (mpirun on this machine) and the Slurm backend (srun inside an
allocation) differ only in how the ranks start and where the job directory
lives; everything else is here, one module per concern, and each backend
imports it rather than the other backend:

- ``job_dir``: the directory's paths (shaped like ``/opt/ml``) and its atomic creation;
  ``layout``: what a job spec puts in it (config files, ``job.json``); ``launch``: creating it;
- ``container_env``: the SageMaker container variables every rank sees;
- ``supervisor``: the process that owns a running job (``Supervisor``, subclassed per launcher),
  with ``log_pump``, ``rank_tags``, ``rank_watch``, ``process_session``, ``retry``,
  ``status``/``status_writer``, ``packaging`` and ``failure``;
- ``job``: the handle a client holds (``SupervisedJob``), with ``log_follower`` and ``summary``;
- ``attach``/``known_paths``: finding a job directory again; ``rules``: the Estimator's checks
  for jobs whose files are on this machine or a file system it sees.

Nothing here imports a backend.
"""
