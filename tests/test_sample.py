"""``python -m models.sample`` on tiny trained runs (GPT and Qwen, a few steps each): a fixed
seed gives a fixed sample, greedy takes the argmax, and the logits each token was drawn from
are those of a forward pass of the model over the generated sequence; missing runs,
checkpoints and configs are named."""

import contextlib
import io
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import data, parallel, sample, train
from models.configs.models import TINY_RUN

TINY = [
  *TINY_RUN,
  "--warmup",
  "2",
  "--eval-batches",
  "1",
  "--eval-every",
  "100",
  "--no-progress",
  "--no-hlo-wire",
  "--no-exact-twin",
  "--steps",
  "6",
  "--sample-tokens",
  "8",
]
CONTEXT = 32
# What each run of the fixture printed, by its output directory.
PRINTED: dict = {}


@pytest.fixture(scope="module", params=[("gpt", "2,1,2"), ("qwen", "2,2,1")], ids=["gpt", "qwen"])
def run(request, tmp_path_factory):
  model, mesh = request.param
  out = tmp_path_factory.mktemp(model) / "run"
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    train.main(TINY + ["--model", model, "--mesh", mesh, "--out", str(out)])
  PRINTED[out] = printed.getvalue()
  return out


def _reference_forward(out):
  """The model of the run with the checkpoint's parameters, called on whole sequences."""
  cfg = sample.run_config(out)
  vocab = data.load_vocab(cfg["tokenizer"], max_chars=cfg["max_chars"])
  model = sample.build(cfg, vocab.size)
  params, _ = sample.load_params(out)
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, parallel.unstack_params(jax.tree.map(jnp.asarray, params)))
  nnx.update(model, state)
  # The weights are arguments, not constants that XLA could fold into another program.
  graphdef, weights = nnx.split(model)
  f = jax.jit(lambda w, t: nnx.merge(graphdef, w)(t))
  return (lambda t: f(weights, t)), vocab


@pytest.mark.slow
def test_fixed_seed_gives_fixed_sample(run, capsys):
  argv = ["--out", str(run), "--length", "24", "--temperature", "1.0", "--top-k", "8"]
  a = sample.main(argv + ["--seed", "5"])
  b = sample.main(argv + ["--seed", "5"])
  c = sample.main(argv + ["--seed", "6"])
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert a.text == b.text and len(a.tokens) == 24
  assert not np.array_equal(a.tokens, c.tokens)
  # top-k: every drawn token is among the 8 largest logits of its row.
  for tok, row in zip(a.tokens, a.logits):
    assert (row > row[tok]).sum() < 8
  assert capsys.readouterr().out.startswith(sample.DEFAULT_PROMPT + a.text)


def test_greedy_is_argmax(run):
  s = sample.main(["--out", str(run), "--length", "16", "--temperature", "0"])
  np.testing.assert_array_equal(s.tokens, s.logits.argmax(-1))


def test_logits_are_the_models_forward_pass(run):
  """Each row of the sampler's logits is the model's output at that position for the
  sequence generated so far: exactly, because the sampler reads a right-padded window of the
  same length as the reference's input, and causal attention gives the padded positions
  exact zero weight (the rows that are read see the same values in the same order)."""
  forward, vocab = _reference_forward(run)
  prompt = vocab.encode("ROMEO:")
  length = CONTEXT - prompt.size + 6  # the last 6 tokens slide the window
  s = sample.main(
    [
      "--out",
      str(run),
      "--prompt",
      "ROMEO:",
      "--length",
      str(length),
      "--temperature",
      "0.7",
      "--seed",
      "2",
    ]
  )
  seq = np.concatenate([prompt, s.tokens])
  full = np.asarray(forward(seq[None, :CONTEXT]))[0]
  p = prompt.size
  np.testing.assert_array_equal(s.logits[: CONTEXT - p + 1], full[p - 1 :])
  for i in range(CONTEXT - p + 1, length):
    window = seq[p + i - CONTEXT : p + i]
    np.testing.assert_array_equal(s.logits[i], np.asarray(forward(window[None]))[0, -1])


def test_mesh_sampling_matches_one_device(run):
  """On a 2x2x2 mesh the tensor split sums each row-parallel projection in two float32
  halves, a different association than one device's single sum; the pipe and data axes add
  nothing but exact zeros. Each reassociated sum differs by a few float32 ulps of its terms
  (|x| <~ 10 here, ulp 1e-6), carried through two tiny layers: 2e-5 leaves room for that,
  and is far below what any wrong shard or stage (differences of order 0.1-1) would give."""
  cfg = sample.run_config(run)
  vocab = data.load_vocab(cfg["tokenizer"], max_chars=cfg["max_chars"])
  params, _ = sample.load_params(run)
  seq = np.concatenate(
    [
      vocab.encode("ROMEO:"),
      sample.main(["--out", str(run), "--prompt", "ROMEO:", "--length", str(CONTEXT - 6)]).tokens,
    ]
  )[None]
  one = np.asarray(sample.single_device_forward(sample.build(cfg, vocab.size), params)(seq))
  mesh = np.asarray(sample.mesh_forward(sample.build(cfg, vocab.size), params, (2, 2, 2))(seq))
  np.testing.assert_allclose(mesh, one, rtol=0, atol=2e-5)
  # The command line on the mesh: the first row depends on the prompt only.
  s = sample.main(["--out", str(run), "--prompt", "ROMEO:", "--length", "3", "--mesh", "2,2,2"])
  np.testing.assert_allclose(s.logits[0], one[0, 5], rtol=0, atol=2e-5)


def test_config_json_names_the_model(run):
  # models.sample rebuilds the model from what the run recorded.
  cfg = json.loads((run / "config.json").read_text())
  assert cfg["seq_len"] == CONTEXT and cfg["size"] == "tiny"


def test_final_loss_line_is_followed_by_a_sample(run):
  text = PRINTED[run]
  after = text[text.index("\nloss ") :]
  assert "sample (8 tokens, temperature 0.8, seed 0" in after
  assert sample.DEFAULT_PROMPT.strip() in after


def test_errors_name_what_is_missing(run, tmp_path, monkeypatch, capsys):
  def err(argv):
    assert sample.cli(argv) == 2
    return capsys.readouterr().err

  monkeypatch.chdir(tmp_path)
  monkeypatch.delenv("JCOCCL_RUNS_DIR")  # the default: runs/ in the current directory
  assert "--name nope: no run directory runs/nope" in err(["--name", "nope"])
  assert "give --name" in err([])
  assert "--out: no run directory" in err(["--out", str(tmp_path / "x")])
  (tmp_path / "runs" / "empty").mkdir(parents=True)
  assert "config.json is missing" in err(["--name", "empty"])
  shutil.copy(run / "config.json", tmp_path / "runs" / "empty")
  assert "no checkpoint under runs/empty/ckpt" in err(["--name", "empty"])
  assert "--step 99: no checkpoint at that step" in err(["--out", str(run), "--step", "99"])
  assert "'\\x01' at position 1" in err(["--out", str(run), "--prompt", "a\x01"])
  assert "--temperature must be" in err(["--out", str(run), "--temperature", "-1"])
  assert "--top-k must be >= 1" in err(["--out", str(run), "--top-k", "0"])
  assert "--mesh must be three" in err(["--out", str(run), "--mesh", "2,2"])


def test_vocab_matches_corpus():
  corpus = data.load_corpus("char", max_chars=50000)
  vocab = data.load_vocab("char", max_chars=50000)
  assert vocab.itos == corpus.itos and vocab.size == corpus.vocab_size
  text = corpus.decode(corpus.val[:40])
  np.testing.assert_array_equal(vocab.encode(text), corpus.val[:40])
  bpe = data.load_vocab("bpe")
  assert bpe.size == 50257 and bpe.decode(bpe.encode("Romeo, Romeo")) == "Romeo, Romeo"
