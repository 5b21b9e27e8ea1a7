"""The engine: starting ranks, the records they write, and the plots drawn from them.

It knows no lesson: nothing here imports a chapter's subpackage (tests/test_layout.py checks it).

- ``env``: rank, local rank, world size, backend and device choice, seeding, threads, ``distributed()``
- ``launcher``: the checks and ``launch(worker, cfg, nprocs) -> Run``
- ``run``: ``Run``, ``RunResult``, ``WorkerFailed`` and the root cause of a failure
- ``_rank``: the first code inside a rank
- ``runlog``: the record schema (one writer per kind) and the incremental reader
- ``live``: live plot, progress bar and loss figure, drawn from records only
- ``procs``: a job's processes (the launcher, the notebooks' last cells and the tests share it)
"""
