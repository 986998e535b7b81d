"""The model families (models/registry.py) and the run config built from the command line."""

from __future__ import annotations

import dataclasses

import pytest
from flax import nnx

from models import cli, gpt, qwen, registry
from models.run_config import RunConfig, build_model


def test_each_model_module_declares_its_family():
  assert registry.FAMILIES == {"gpt": gpt.FAMILY, "qwen": qwen.FAMILY}
  assert registry.SIZES == ("tiny", "small", "base", "wide")
  model = build_model(_cfg(model="qwen", size="tiny", seq_len=32, seed=0), vocab=65)
  assert registry.family_of(model) is qwen.FAMILY
  assert qwen.FAMILY.layers(model.cfg) == 2
  assert qwen.FAMILY.heads(model.cfg) == (4, 2, 64)


def test_gpt_positions_cover_the_sequence_length():
  assert gpt.FAMILY.config("tiny", 65, 32).n_positions == 64
  assert gpt.FAMILY.config("tiny", 65, 200).n_positions == 200


def test_unknown_family_is_named():
  with pytest.raises(ValueError, match=r"model must be one of \['gpt', 'qwen'\], got 'bert'"):
    registry.get("bert")
  with pytest.raises(TypeError, match="models.gpt.GPT or models.qwen.Qwen, got Linear"):
    registry.family_of(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


def test_run_config_holds_every_checked_flag(tmp_path):
  args = cli.parse_args(
    ["--size", "tiny", "--compress", "data.all_reduce=int4", "--out", str(tmp_path)]
  )
  cfg = RunConfig.from_args(args)
  assert cfg.mesh_shape == (2, 2, 2) and cfg.compress == ("data.all_reduce=int4",)
  assert cfg.out == tmp_path and cfg.policy_path.name == "coccl.toml"
  flags = {a.dest for a in cli.build_parser()._actions if a.dest != "help"}
  assert flags <= {f.name for f in dataclasses.fields(RunConfig)}
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.steps = 1  # type: ignore[misc]


def _cfg(**kw):
  """An object with the attributes build_model reads."""
  return type("Cfg", (), kw)


def test_codec_flag_takes_a_python_file(tmp_path):
  """models.train --codec path/to/file.py registers the file's codec before --compress is
  checked (the rule of jcoccl.compressors.import_codecs)."""
  from jcoccl import compressors as jc

  (tmp_path / "trunc_cli.py").write_text(
    "import jcoccl.compressors as jc\n"
    "from jcoccl._src.compressors.identity import CastCompressor\n"
    "@jc.register('trunc_cli', keys={})\n"
    "class TruncCli(CastCompressor):\n"
    "  pass\n"
  )
  try:
    args = cli.parse_args(
      ["--size", "tiny", "--codec", str(tmp_path / "trunc_cli.py"),
       "--compress", "data.all_reduce=trunc_cli", "--out", str(tmp_path / "run")]
    )  # fmt: skip
    assert args.codec == [str(tmp_path / "trunc_cli.py")]
  finally:
    jc.unregister("trunc_cli")
