"""Chapters 05a-05c: torchrun, several nodes, restarts and hangs.

- ``torchrun``: torchrun commands, its agents, nodes simulated on one machine (chapter 05a)
- ``elastic``: ``ElasticConfig``, ``ElasticTrainer`` (snapshots every k steps, an injected fault)
  and ``elastic_worker``, restarted by ``torchrun --max-restarts`` (chapter 05b)
- ``restarts``: a restart across two nodes whose agents count restarts differently, simulated
  (chapter 05b)
- ``hangs``: the hang worker, where each rank waits, faulthandler, py-spy (chapter 05c)
- ``slurm``: the SLURM batch script run without SLURM, to see what it starts (chapter 05a)
- ``output``: turning torchrun's output into what a cell shows
"""
