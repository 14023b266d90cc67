"""Tensor, context and pipeline parallelism on one device mesh (with FSDP2 data parallelism).

- ``config.py``: ``ParallelConfig`` (``pretrain.train.parallel``), resolved against a world size and
  checked before any compute;
- ``mesh.py``: the named device mesh ``(pp, dp_replicate, dp_shard, cp, tp)``, TP innermost;
- ``tp.py``, ``cp.py``, ``pp.py``: each parallelism applied to the model;
- ``parts.py``: ``Parallelism``, what the trainer does per layout, composed from them.
"""
