"""Prints the tables of README.md from the JSON files next to it.

python benchmarks/results/2026-12-05-gspmd/summarize.py
"""

from __future__ import annotations

import json
import pathlib
import statistics

HERE = pathlib.Path(__file__).parent


def load(path: pathlib.Path) -> dict:
  return json.loads(path.read_text())


def accuracy() -> None:
  print("| seed | original loss @200 | int8 + EF loss @200 | difference |")
  print("|---|---|---|---|")
  for seed in range(3):
    o = load(HERE / "accuracy" / f"orig-{seed}.json")["losses"][-1]
    i = load(HERE / "accuracy" / f"int8ef-{seed}.json")["losses"][-1]
    print(f"| {seed} | {o:.4f} | {i:.4f} | {100 * (i - o) / o:+.2f}% |")
  n = load(HERE / "accuracy" / "none-0.json")
  o = load(HERE / "accuracy" / "orig-0.json")
  diffs = [abs(a - b) for a, b in zip(n["losses"], o["losses"])]
  first = next((k for k, d in enumerate(diffs) if d), None)
  print(
    f"\nnone vs original (seed 0): first differing step {first}, largest loss difference "
    f"{max(diffs):.2e}, final {n['losses'][-1]:.6f} vs {o['losses'][-1]:.6f}, parameters "
    f"bitwise equal: {n['fingerprint'] == o['fingerprint']}"
  )


def resume() -> None:
  d = HERE / "resume"
  if not d.exists():
    return
  for tag in ("", "mp-"):
    s, r = load(d / f"{tag}straight.json"), load(d / f"{tag}resumed.json")
    same = s["fingerprint"] == r["fingerprint"] and s["ef_fingerprint"] == r["ef_fingerprint"]
    print(
      f"{tag or 'one process '}resume: params+EF checksum straight {s['fingerprint']}/"
      f"{s['ef_fingerprint']} resumed {r['fingerprint']}/{r['ef_fingerprint']}: "
      f"{'bit-exact' if same else 'DIFFERENT'}; losses of steps 10-19 equal: "
      f"{s['losses'][10:] == r['losses']}"
    )


def timing(folder: str) -> None:
  d = HERE / folder
  if not d.exists():
    return
  print(f"\n{folder}/:")
  print("| repeat | original s/step | int8 + EF s/step | ratio |")
  print("|---|---|---|---|")
  ratios = []
  for r in (1, 2, 3):
    if not (d / f"orig-{r}.json").exists() or not (d / f"int8ef-{r}.json").exists():
      print(f"| {r} | missing | missing | - |")
      continue
    o = statistics.median(load(d / f"orig-{r}.json")["step_s"][5:])
    i = statistics.median(load(d / f"int8ef-{r}.json")["step_s"][5:])
    ratios.append(i / o)
    print(f"| {r} | {o:.3f} | {i:.3f} | {i / o:.3f} |")
  if ratios:
    print(
      f"\nratio median {statistics.median(ratios):.3f}, "
      f"range {min(ratios):.3f}-{max(ratios):.3f} ({len(ratios)} repeats)"
    )


if __name__ == "__main__":
  accuracy()
  resume()
  timing("timing")  # the shared machine's runs
  timing("timing-quiet")  # rerun alone on the machine
