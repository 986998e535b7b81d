"""Flax NNX GPT-2 and Qwen2 trained with data, tensor and pipeline parallelism over jcoccl.

``models.gpt`` and ``models.qwen`` hold the models (with ``from_hf`` loaders and their
``FAMILY`` entries, keyed by name in ``models.registry``), ``models.parallel`` the
3D-parallel training step (over ``models.sharding``, ``models.collectives``,
``models.grad_sync`` and ``models.zero``), ``models.recipe`` the training recipe (the
jcoccl.Policy of a models/configs TOML file plus its ``[data]`` switches
``error_feedback``, ``zero``, ``nodes``), ``models.pipeline`` the micro-batch schedule,
``models.data`` the Shakespeare corpus, ``models.train`` the training script
(``python -m models.train --help``; its jobs in ``models.cli``, ``models.run_config``,
``models.checkpoint``, ``models.metrics`` and ``models.loop``) and ``models.sample`` text
generation from a run.
"""
