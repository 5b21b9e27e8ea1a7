"""Chapter 10: context parallelism (notebooks/10a_context_parallel.ipynb) and expert parallelism
with all five dimensions on one mesh (notebooks/10b_expert_parallel.ipynb).

- ``attention_cost``: attention's bytes and FLOPs against the sequence length
- ``online_softmax``: one key/value block at a time: the merge of two blocks, gradients
- ``ring_attention``: ring attention by hand (send/recv of k/v blocks), forward and backward
- ``zigzag``: which tokens each rank holds, contiguous or zig-zag, and the causal work per rank
- ``cp_worker``: the context-parallel worker, every case checked against one process
- ``moe``: a mixture-of-experts layer on one process (router, top-k, capacity, balancing loss)
- ``expert_parallel``: the same layer with its experts split over ranks, all-to-all by hand
- ``ep_worker``: the expert-parallel worker, checked against the one-process layer
- ``mesh5d``: a (pp, dp, ep, cp, tp) layout: collectives, memory and step time per GPU
- ``config``: the workers' configurations, their refusals and the tensors every rank draws
"""
