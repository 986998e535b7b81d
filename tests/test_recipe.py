"""models.recipe: the training switches (error_feedback, zero, nodes) split off the same TOML
files, dicts and command-line specs that hold the jcoccl.Policy; every bad entry is refused with
an error naming it as its source writes it."""

import pytest

import jcoccl.compressors as jc
from jcoccl.policy import Policy
from models.recipe import Recipe, as_recipe
from models.train import CONFIGS

AXES = ("data", "tensor", "pipe")

# (entry, key, value, message pattern): a switch off the data axis, an out-of-range value,
# an unknown key (the accepted list includes the switches), and jcoccl.Policy's own errors,
# which the recipe passes on with the same naming.
BAD_ENTRIES = [
  ("tensor", "zero", True, "zero applies to the 'data' axis only"),
  ("pipe", "zero", False, "zero applies to the 'data' axis only"),
  ("*", "zero", True, "zero applies to the 'data' axis only"),
  ("tensor", "error_feedback", True, "error_feedback applies to the 'data' axis only"),
  ("*", "error_feedback", True, "error_feedback applies to the 'data' axis only"),
  ("node", "nodes", 2, "nodes applies to the 'data' axis only"),
  ("data", "nodes", 0, "must be a positive int"),
  ("data", "zeroo", True, "unknown key 'zeroo'.*error_feedback, zero, nodes.*did you mean 'zero'"),
  ("data", "allreduce", "int8", "unknown key 'allreduce'.*did you mean 'all_reduce'"),
  ("data", "algorithm", "ring", "must be one of .*'two_shot'.*got 'ring'"),
  ("data", "all_reduce", "int9", "cannot parse compressor spec"),
  ("model", "all_reduce", "int8", "unknown axis 'model'"),
]

# Values of the wrong type: TypeError from a dict, ValueError from a file.
BAD_TYPES = [
  ("zero", "yes", "must be a bool"),
  ("error_feedback", 1, "must be a bool"),
  ("nodes", True, "must be a positive int"),
  ("nodes", 1.5, "must be a positive int"),
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
    Recipe.from_dict({axis: {key: value}}, axes=AXES)
  assert f"policy[{axis!r}]" in str(e.value)


@pytest.mark.parametrize("axis,key,value,match", BAD_ENTRIES)
def test_bad_toml_entry_names_file_table_and_key(tmp_path, axis, key, value, match):
  f = tmp_path / "bad.toml"
  f.write_text(
    f'[data]\nall_reduce = "int8"\n\n{_toml_table(axis)}\n{key} = {_toml_value(value)}\n'
    if axis != "data"
    else f"[data]\n{key} = {_toml_value(value)}\n"
  )
  with pytest.raises(ValueError, match=match) as e:
    Recipe.from_toml(str(f), axes=AXES)
  where = f"{f}: {_toml_table(axis)}"
  assert str(e.value).startswith(where), (str(e.value), where)
  if "unknown axis" not in match and "unknown key" not in match:
    assert str(e.value).startswith(f"{where} {key}")


@pytest.mark.parametrize("key,value,match", BAD_TYPES)
def test_wrong_types(tmp_path, key, value, match):
  with pytest.raises(TypeError, match=f"policy\\['data'\\]\\['{key}'\\] {match}"):
    Recipe.from_dict({"data": {key: value}}, axes=AXES)
  f = tmp_path / "bad.toml"
  f.write_text(f"[data]\n{key} = {_toml_value(value)}\n")
  with pytest.raises(ValueError, match=f"bad.toml: \\[data\\] {key} {match}"):
    Recipe.from_toml(str(f), axes=AXES)


@pytest.mark.parametrize(
  "text,match",
  [
    ("[data\n", "not valid TOML"),
    ("zero = true\n", r"\[zero\] must be a table"),
    ("[data]\nzero = true\n[data.x]\ny = 1\n", r"\[data\] has unknown key 'x'"),
  ],
)
def test_malformed_toml_files(tmp_path, text, match):
  f = tmp_path / "p.toml"
  f.write_text(text)
  with pytest.raises(ValueError, match=match):
    Recipe.from_toml(str(f), axes=AXES)


@pytest.mark.parametrize(
  "spec,match",
  [
    ("tensor.zero=true", r"tensor.zero: zero applies to the 'data' axis only"),
    ("data.zero=maybe", r"data.zero: zero must be true or false"),
    ("data.error_feedback=yes", r"data.error_feedback: error_feedback must be true or false"),
    ("data.nodes=two", r"data.nodes: nodes must be a positive integer"),
    ("data.nodes=0", r"data.nodes must be a positive int"),
    ("data.all_reduce=int8:", r"data.all_reduce: cannot parse"),
    ("data.bogus=1", "data has unknown key 'bogus'"),
    ("data=int8", "axis.op=spec"),
  ],
)
def test_bad_specs(spec, match):
  with pytest.raises(ValueError, match=match):
    Recipe.from_specs([spec], axes=AXES)


def test_switches_split_from_the_policy(tmp_path):
  """The switches land on the Recipe, the rest on its jcoccl.Policy, from each source."""
  table = {
    "data": {
      "zero": True,
      "error_feedback": True,
      "nodes": 2,
      "reduce_scatter": "int4",
      "min_bytes": 0,
    },
    "tensor": {"all_reduce": "fp8"},
  }
  f = tmp_path / "r.toml"
  f.write_text(
    '[data]\nzero = true\nerror_feedback = true\nnodes = 2\nreduce_scatter = "int4"\n'
    'min_bytes = 0\n[tensor]\nall_reduce = "fp8"\n'
  )
  specs = [
    "data.zero=true",
    "data.error_feedback=1",
    "data.nodes=2",
    "data.reduce_scatter=int4",
    "data.min_bytes=0",
    "tensor.all_reduce=fp8",
  ]
  for r in (
    Recipe.from_dict(table, axes=AXES),
    Recipe.from_toml(str(f), axes=AXES),
    Recipe.from_specs(specs, axes=AXES),
  ):
    assert (r.zero, r.error_feedback, r.nodes) == (True, True, 2)
    assert r.policy.compressor("data", "reduce_scatter") == jc.int4()
    assert r.policy.options("data")["min_bytes"] == 0
    assert r.policy.compressor("tensor", "all_reduce") == jc.fp8()
    assert r.source == table
    assert r.describe() == (
      "data: reduce_scatter=int4 error_feedback zero nodes=2 min_bytes=0\ntensor: all_reduce=fp8"
    )


def test_defaults_and_as_recipe():
  r = Recipe.from_dict({"*": {"all_reduce": "int8"}})
  assert (r.zero, r.error_feedback, r.nodes) == (False, False, 1)
  p = Policy.from_dict({"data": {"all_reduce": "int8"}})
  assert as_recipe(p).policy is p and not as_recipe(p).zero
  assert as_recipe(None) == Recipe() and Recipe().describe() == "exact everywhere"
  assert as_recipe({"data": {"zero": True}}).zero
  with pytest.raises(TypeError, match="recipe must be a models.recipe.Recipe"):
    as_recipe("coccl")


@pytest.mark.parametrize("name", ["exact", "coccl", "int8", "zeropp", "lean", "int3"])
def test_shipped_configs_are_valid(name):
  Recipe.from_toml(str(CONFIGS / f"{name}.toml"), axes=("node", *AXES))


def test_shipped_switches():
  coccl = Recipe.from_toml(str(CONFIGS / "coccl.toml"))
  assert (coccl.zero, coccl.error_feedback, coccl.nodes) == (False, True, 1)
  zeropp = Recipe.from_toml(str(CONFIGS / "zeropp.toml"))
  assert (zeropp.zero, zeropp.error_feedback, zeropp.nodes) == (True, True, 2)


DIRECTED = '[tensor]\nall_reduce = "int8"\nmin_bytes = 0\n\n[directions]\n'


@pytest.mark.parametrize(
  "line,error,match",  # in a file a wrong type is a bad value (jcoccl.policy.Origin)
  [
    ('"tensor.sideways" = "int4"', ValueError, r"p.toml: \[directions\] tensor.sideways: .*points"),
    ('"tensor.backward" = "int99"', ValueError, r"\[directions\] tensor.backward: .*int99"),
    ('"pipe.forward" = 3', ValueError, r"\[directions\] pipe.forward must be a codec spec"),
  ],
)
def test_bad_directions_name_the_file_and_point(tmp_path, line, error, match):
  (tmp_path / "p.toml").write_text(DIRECTED + line + "\n")
  with pytest.raises(error, match=match):
    Recipe.from_toml(str(tmp_path / "p.toml"))


def test_a_policy_files_directions_reach_the_trainer(tmp_path):
  """[directions] in the file, --direction over it: models.train builds its collectives
  (models.directed.DirectedParallel) from both."""
  from models import cli, train

  p = tmp_path / "p.toml"
  p.write_text(DIRECTED + '"tensor.backward" = "hadamard(int3)"\n"pipe.forward" = "int4"\n')
  recipe = Recipe.from_toml(str(p))
  assert recipe.directions == {"tensor.backward": "hadamard(int3)", "pipe.forward": "int4"}
  assert recipe.describe().splitlines()[-1] == (
    "directions: tensor.backward=hadamard(int3) pipe.forward=int4"
  )
  assert recipe.policy.compressor("tensor", "all_reduce") == jc.parse("int8")
  args = cli.parse_args(["--policy", str(p), "--direction", "pipe.forward=exact"])
  assert train.run_directions(cli.load_policy(args), args.directions) == {
    "tensor.backward": "hadamard(int3)",
    "pipe.forward": "exact",
  }
