"""Chapter 08: tensor parallelism.

- ``fg``: Megatron's f and g by hand, the block and its hand-sharded version, DTensor plans
- ``mesh2d``: the 1-D worker, collective counts, the 2-D mesh and its figure
- ``pitfalls``: what goes wrong with tensor-parallel gradients, clipping and dropout
"""
