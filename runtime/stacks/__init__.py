"""shardlang's optimizers inside the training stacks people use (docs/stacks/).

Each module imports its stack (an optional extra: ``pip install shardlang[hf]``) and is imported
only by those who use it: ``runtime.stacks.hf`` (Hugging Face ``Trainer``), ``runtime.stacks.fsdp2``
(accelerate's FSDP2 plugin: the optimizer built over the sharded parameters),
``runtime.stacks.lightning`` (Lightning's DDP strategy). DCP needs no extra: ``runtime.optim.dcp``;
nor does ``runtime.stacks.profiler`` (a profiled step's trace for ``shardlang timeline``).
"""
