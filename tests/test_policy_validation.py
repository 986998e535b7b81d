"""Policy and compressor-spec validation: every malformed entry is refused when the policy is
built, with an error that names the entry as its source writes it (dict, TOML file, specs)."""

import itertools

import pytest

import jcoccl.compressors as jc
from jcoccl import policy as policy_module
from jcoccl._src.compressors.compressor_args import resolve_compressor
from jcoccl._src.ops import all_reduce as ar
from jcoccl.policy import OPS, Policy

AXES = ("data", "tensor", "pipe")

# (entry, key, value, message pattern): one bad value per class of input, for every op and
# option. The key is where the error must point.
BAD_ENTRIES = (
  [
    ("model", "all_reduce", "int8", "unknown axis 'model'"),
    ("dat", "all_reduce", "int8", "unknown axis 'dat'.*did you mean 'data'"),
    ("data", "allreduce", "int8", "unknown key 'allreduce'.*did you mean 'all_reduce'"),
    ("data", "broadcast", "int8", "unknown key 'broadcast'"),
    ("data", "algorithm", "ring", "must be one of .*'two_shot'.*got 'ring'"),
    ("data", "algorithm", "hierarchical", "'hierarchical' needs .* two or more axes"),
    ("data", "min_bytes", -1, "must be a non-negative int"),
  ]
  + [
    (axis, key, value, f"{key} is a training option of models/ \\(models.recipe.Recipe")
    for axis, key, value in [
      ("data", "zero", True),
      ("data", "error_feedback", False),
      ("data", "nodes", 2),
      ("tensor", "zero", True),
      ("*", "error_feedback", True),
    ]
  ]
  + [
    (axis, op, spec, "cannot parse compressor spec")
    for axis, op, spec in zip(
      itertools.cycle(AXES), OPS, ["int8:", "int8:sym,asym", "int9", "fp8:e4m3,e5m2", "eb"]
    )
  ]
  + [
    ("data", "all_reduce", "", "empty compressor spec"),
    ("data", "ppermute", "  ", "empty compressor spec"),
  ]
)

# Values of the wrong type: TypeError from a dict, ValueError from a file.
BAD_TYPES = [
  ("data", "min_bytes", 1.5, "must be a non-negative int"),
  ("data", "min_bytes", True, "must be a non-negative int"),
  ("data", "algorithm", 2, "must be a string"),
  ("data", "all_reduce", 8, "must be a compressor spec string"),
]


def _toml_value(v):
  if isinstance(v, bool):
    return "true" if v else "false"
  return repr(v).replace("'", '"') if isinstance(v, str) else repr(v)


def _toml_table(axis):
  return f'["{axis}"]' if axis == "*" else f"[{axis}]"


@pytest.mark.parametrize("axis,key,value,match", BAD_ENTRIES)
def test_bad_dict_entry_names_axis_and_key(axis, key, value, match):
  with pytest.raises(ValueError, match=match) as e:
    Policy.from_dict({axis: {key: value}}, axes=AXES)
  assert f"policy[{axis!r}]" in str(e.value)


@pytest.mark.parametrize("axis,key,value,match", BAD_ENTRIES)
def test_bad_toml_entry_names_file_table_and_key(tmp_path, axis, key, value, match):
  f = tmp_path / "bad.toml"
  f.write_text(f"{_toml_table(axis)}\n{key} = {_toml_value(value)}\n")
  with pytest.raises(ValueError, match=match) as e:
    Policy.from_toml(str(f), axes=AXES)
  where = f"{f}: {_toml_table(axis)}"
  assert str(e.value).startswith(where), (str(e.value), where)
  if "unknown axis" not in match and "unknown key" not in match:
    assert str(e.value).startswith(f"{where} {key}")


@pytest.mark.parametrize("axis,key,value,match", BAD_TYPES)
def test_wrong_types(tmp_path, axis, key, value, match):
  with pytest.raises(TypeError, match=match):
    Policy.from_dict({axis: {key: value}}, axes=AXES)
  f = tmp_path / "bad.toml"
  f.write_text(f"[{axis}]\n{key} = {_toml_value(value)}\n")
  with pytest.raises(ValueError, match=f"bad.toml: \\[{axis}\\] {key} {match}"):
    Policy.from_toml(str(f), axes=AXES)


@pytest.mark.parametrize(
  "text,match",
  [
    ('all_reduce = "int8"\n', r"\[all_reduce\] must be a table"),
    ("[data\n", "not valid TOML"),
    ('[data]\nall_reduce = { spec = "int8" }\n', r"\[data\] all_reduce must be a compressor spec"),
    ('[data]\nall_reduce = "int8"\n[data.x]\ny = 1\n', r"\[data\] has unknown key 'x'"),
  ],
)
def test_malformed_toml_files(tmp_path, text, match):
  f = tmp_path / "p.toml"
  f.write_text(text)
  with pytest.raises(ValueError, match=match):
    Policy.from_toml(str(f), axes=AXES)


@pytest.mark.parametrize(
  "spec,match",
  [
    ("model.all_reduce=int8", "model: unknown axis 'model'"),
    ("data.all_reduce=int8:", r"data.all_reduce: cannot parse"),
    ("data.all_reduce=int8:sym,asym", r"data.all_reduce: cannot parse"),
    ("data.algorithm=ring", r"data.algorithm must be one of"),
    ("data.zero=true", r"data.zero: zero is a training option of models/"),
    ("data.nodes=2", r"data.nodes: nodes is a training option of models/"),
    ("data.min_bytes=-1", r"data.min_bytes: min_bytes must be a non-negative integer"),
    ("data.min_bytes=1e6", r"data.min_bytes: min_bytes must be a non-negative integer"),
    ("data.bogus=1", "data has unknown key 'bogus'"),
    ("data=int8", "axis.op=spec"),
    (".all_reduce=int8", "axis.op=spec"),
  ],
)
def test_bad_specs(spec, match):
  with pytest.raises(ValueError, match=match):
    Policy.from_specs([spec], axes=AXES)


def test_axes_unchecked_without_a_mesh():
  """Without ``axes`` any axis name is accepted (the policy does not know the mesh)."""
  p = Policy.from_dict({"model": {"all_reduce": "int8"}})
  assert p.compressor("model", "all_reduce") == jc.int8()


def test_good_policies_load():
  p = Policy.from_dict(
    {
      "data": {
        "all_reduce": "hadamard(int4):size=64",
        "algorithm": "two_shot",
        "min_bytes": 0,
        "ppermute": "off",
        "all_gather": None,
      },
      "*": {"all_reduce": jc.int8(), "algorithm": "one_shot"},
    },
    axes=AXES,
  )
  assert p.compressor("data", "all_reduce") == jc.hadamard(jc.int4(), size=64)
  assert p.compressor("data", "ppermute") is None
  assert p.options("tensor") == {"algorithm": "one_shot"}
  assert "algorithm=two_shot" in p.describe()


@pytest.mark.parametrize("name", ["exact", "int8"])
def test_shipped_configs_without_training_switches_are_policies(name):
  """Configs without models/' training switches load as plain jcoccl policies (the others:
  tests/test_recipe.py)."""
  from models.train import CONFIGS

  Policy.from_toml(str(CONFIGS / f"{name}.toml"), axes=AXES)


def test_training_switches_point_to_models_recipe(tmp_path):
  """A models/configs file with training switches is refused by jcoccl.Policy, and the
  message says where the switches belong and how to read the file."""
  from models.train import CONFIGS

  with pytest.raises(ValueError) as e:
    Policy.from_toml(str(CONFIGS / "coccl.toml"))
  msg = str(e.value)
  assert msg.startswith(f"{CONFIGS / 'coccl.toml'}: [data] error_feedback: "), msg
  assert "models.recipe.Recipe.from_toml" in msg and "python -m models.train" in msg


def test_policy_algorithms_are_all_reduce_algorithms():
  assert set(policy_module.ALGORITHMS) <= set(ar.ALGORITHMS)
  assert set(ar.ALGORITHMS) - set(policy_module.ALGORITHMS) == {"hierarchical"}


def test_auto_prefix_is_all_reduces_opt_in():
  """'auto:<spec>' is all_reduce's opt-in to the exact op (algorithm "auto_exact"); other
  ops and a pinned algorithm refuse it with the fix; a policy's entry carries it."""
  assert ar.split_auto("auto:int8", "auto") == ("int8", "auto_exact")
  assert ar.split_auto(" auto:fp8", "auto_exact") == ("fp8", "auto_exact")
  assert ar.split_auto("int8", "auto") == ("int8", "auto")
  with pytest.raises(ValueError, match="pins one; write compressor='int8'"):
    ar.split_auto("auto:int8", "two_shot")
  with pytest.raises(ValueError, match="applies to jcoccl.all_reduce's compressor.*'int8'"):
    resolve_compressor("auto:int8")
  p = Policy.from_dict({"data": {"all_reduce": "auto:int8", "all_gather": "int8"}}, axes=AXES)
  assert p.options("data", "all_reduce")["algorithm"] == "auto_exact"
  assert p.options("data", "all_gather")["algorithm"] == "auto"  # the compressed ops' auto
  assert Policy.from_dict({"data": {"algorithm": "auto_exact"}}).options("data") == {
    "algorithm": "auto_exact"
  }


# ---- compressor spec strings (jcoccl.compressors.parse) ----------------------------------

# Every option group of every codec, given twice (same or different value): an error, never
# "the last one wins".
_GROUPS = {
  "int8": [["block=64", "block=128"], ["sym", "asym"], ["nearest", "stochastic"]],
  "int4": [["block=64", "block=64"], ["asym", "asym"], ["stochastic", "nearest"]],
  "int2": [["block=32", "block=256"], ["sym", "sym"], ["nearest", "nearest"]],
  "fp8": [["e4m3", "e5m2"], ["block=64", "block=32"], ["e5m2", "e5m2"]],
  "eb": [["abs=1e-3", "abs=1e-2"], ["abs=1e-3,block=64", "block=128"]],
}
REPEATED = [f"{name}:{a},{b}" for name, groups in _GROUPS.items() for a, b in groups]


@pytest.mark.parametrize("spec", REPEATED)
def test_parse_rejects_repeated_options(spec):
  with pytest.raises(ValueError, match="at most once"):
    jc.parse(spec)
  with pytest.raises(ValueError, match="at most once"):
    jc.parse(f"hadamard({spec})")


@pytest.mark.parametrize(
  "name", ["none", "bf16", "fp16", "int8", "int4", "int2", "fp8", "eb", "hadamard(int4)"]
)
def test_parse_rejects_a_colon_without_options(name):
  with pytest.raises(ValueError, match="bad compressor spec"):
    jc.parse(name + ":")


@pytest.mark.parametrize(
  "spec",
  [
    "int8:block=1_024",
    "int8:block=+256",
    "int8:block=",
    "int8:block=0x100",
    "int8:block=2.5e2",
    "fp8:block=-64",
    "hadamard(int4):size=+64",
    "hadamard(int4):size=1_28",
    "eb:abs=nan",
    "eb:abs=inf",
    "eb:abs=1_0",
    "eb:abs=",
    "int8:,",
    "int8:sym,",
    "int8::sym",
    "hadamard(int4):size=64:size=32",
    "hadamard()",
  ],
)
def test_parse_rejects_malformed_numbers_and_separators(spec):
  with pytest.raises(ValueError, match="bad compressor spec"):
    jc.parse(spec)


@pytest.mark.parametrize(
  "spec,want",
  [
    ("int4:block=128,asym,stochastic", jc.int4(128, False, "stochastic")),
    ("eb:abs=.5,block=64", jc.error_bounded(0.5, 64)),
    ("eb:abs=2E-3", jc.error_bounded(2e-3)),
    ("fp8:block=64,e5m2", jc.fp8("e5m2", 64)),
    ("hadamard(none)", jc.hadamard(jc.none())),
  ],
)
def test_parse_still_accepts_each_option_once(spec, want):
  assert jc.parse(spec) == want
