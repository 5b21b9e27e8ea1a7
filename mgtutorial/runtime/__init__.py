"""The engine: starting ranks, the records they write, and the plots drawn from them.

It knows no lesson: nothing here imports a chapter's subpackage (tests/test_layout.py checks it).

- ``env``: rank, local rank, world size, backend and device choice, seeding, threads,
  ``distributed()``
- ``rounds``: the round every rank of a start agrees on, through a store that outlives starts
- ``machine``: what this machine has and what the course chooses on it (``describe()``)
- ``launcher``: the checks and ``launch(worker, cfg, nprocs) -> Run``
- ``run``: ``Run`` and ``RunResult``; ``torchelastic``: what a run sets in TorchElastic (rank
  files, its loggers silenced while a run is active)
- ``failure``: ``WorkerFailed`` and the root cause of a failure
- ``_rank``: the first code inside a rank
- ``runlog``: the record schema (one writer per kind) and the incremental reader
- ``live``: live plot, progress bar and loss figure, drawn from records only
- ``procs``: a job's processes (the launcher, the notebooks' last cells and the tests share it)
- ``ranks_magic`` (``%%ranks``), ``ranks_pool``, ``ranks_serve``, ``ranks_channel``,
  ``ranks_output``: a pool of ranks that runs notebook cells, for exploring collectives
"""
