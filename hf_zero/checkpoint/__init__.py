"""hf_zero.checkpoint: every checkpoint hf_zero writes or reads -- where a checkpoint is written, in one package.

The format and its guarantees, bottom up:

* ``files.py``        durable writes (fsync), ``manifest.json`` (every file's size and sha256), verification,
                      safe tag resolution, :class:`~hf_zero.checkpoint.files.CheckpointError`;
* ``disk_format.py``  the files of one engine checkpoint tag (``meta.json``, ``zero_rank*.safetensors``, ...)
                      and opening them verified;
* ``commit.py``       the atomic commit of a tag: ``.tmp-<tag>``, the ranks' agreement, one rename, ``latest``;
* ``placement.py``    which directory each rank writes (shared or node-local storage) and which rank finalizes it;
* ``tags.py``         ``checkpoint.tag_validation``;
* ``module_info.py``  what meta.json records about the module, and the ``zero_to_fp32.py`` script;
* ``reshard.py``      the one re-cut: saved shards to this rank's, across data-parallel size, pipeline cut and
                      TP size.

Front-ends, one per engine layout, all built on the above: ``engine.py`` (ZeRO stages 0-3, any data-parallel
size), ``tp.py`` (tensor parallelism), ``pipeline.py`` / ``pipeline_cut.py`` / ``pipeline_tp.py`` (pipelines,
3D), ``zero_to_fp32.py`` (offline consolidation), ``clone.py`` (DeepSpeed's ``clone_tensors_for_torch_save``).
No module imports another's private (``_name``) names, and no two modules import each other
(tests/test_private_imports.py).

Takes the engine as a duck-typed argument (its module, optimizer, groups, counters, process group) and never
imports runtime: may import tensor_parallel, zero, offload, profiling, comm, ops, config and util; runtime,
integrations and the top-level modules import it (the layer table is ``LAYERS`` in ``tests/test_layering.py``).
"""
