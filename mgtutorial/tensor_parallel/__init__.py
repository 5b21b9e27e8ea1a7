"""Chapter 08: tensor parallelism (notebooks/08a_tensor_parallel.ipynb: by hand, DTensor, sequence
parallelism; notebooks/08b_tp_mesh_and_cost.ipynb: the 2-D mesh, cost, pitfalls, the vocabulary).

- ``transformer``: the unsplit block (attention, MLP, LayerNorms) and the head-count refusal
- ``fg``: Megatron's f and g by hand, and the block split with them
- ``plans``: the same split as a DTensor plan (``parallelize_module``), sequence parallelism
- ``config``: the workers' configurations and the tensors every rank draws from them
- ``worker``: the 1-D worker, each split checked against the unsplit block, collectives counted
- ``pitfalls``: what goes wrong with tensor-parallel heads, clipping, foreach and dropout
- ``mesh2d``: a 2-D mesh (FSDP2 over dp × TP over tp), its shard layout and figure
- ``cost``: what TP and DDP move per step, from the sizes
- ``loss``: vocabulary-parallel embedding and head, the loss on sharded logits (``loss_parallel``)
"""
