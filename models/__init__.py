"""Flax NNX GPT-2 and Qwen2 trained with data, tensor and pipeline parallelism over jcoccl.

``models.gpt`` and ``models.qwen`` hold the models (with ``from_hf`` loaders),
``models.parallel`` the 3D-parallel training step, ``models.recipe`` the training recipe
(the jcoccl.Policy of a models/configs TOML file plus its ``[data]`` switches
``error_feedback``, ``zero``, ``nodes``), ``models.pipeline`` the micro-batch
schedule, ``models.data`` the Shakespeare corpus and ``models.train`` the training script
(``python -m models.train --help``).
"""
