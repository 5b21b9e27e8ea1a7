"""Chapters 05a-05b: torchrun, several nodes, restarts and hangs.

- ``torchrun``: torchrun commands, simulated nodes, the hang worker and py-spy
- ``output``: turning torchrun's output into what a cell shows
"""
