"""Progress bars (jsparse/progress.py): tqdm when installed, the plain iterable when not; autotune and the
benchmark suite go through them."""
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse import autotuning
from jsparse.progress import progress_bar
from reference import random_sparse


class FakeTqdm:
  """Records what a tqdm bar was built with and what went through it."""

  made = []

  def __init__(self, iterable, **kwargs):
    self.iterable, self.kwargs, self.seen = iterable, kwargs, []
    FakeTqdm.made.append(self)

  def __iter__(self):
    for item in self.iterable:
      self.seen.append(item)
      yield item


@pytest.fixture
def fake_tqdm(monkeypatch):
  FakeTqdm.made = []
  module = types.SimpleNamespace(tqdm=FakeTqdm)
  monkeypatch.setitem(sys.modules, "tqdm", module)
  monkeypatch.setitem(sys.modules, "tqdm.auto", module)
  return FakeTqdm


def test_without_tqdm_the_iterable_is_returned(monkeypatch):
  monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` raises ImportError
  items = [1, 2, 3]
  assert progress_bar(items, "work") is items


def test_with_tqdm_a_terminal_only_bar_wraps_the_iterable(fake_tqdm):
  out = list(progress_bar(range(4), "work", unit="step"))
  assert out == [0, 1, 2, 3]
  (bar,) = fake_tqdm.made
  assert bar.kwargs["desc"] == "work" and bar.kwargs["unit"] == "step"
  assert bar.kwargs["disable"] is None  # tqdm's "not when stderr is a file or a pipe"


def test_autotune_shows_a_bar_over_the_recorded_convolutions(fake_tqdm, monkeypatch):
  rng = np.random.default_rng(0)
  x = random_sparse(rng, (4, 4, 4), 4, density=0.5, pad=3)
  w = jnp.asarray(rng.standard_normal((3, 3, 3, 4, 4)), jnp.float32)
  tuned = []
  monkeypatch.setattr(autotuning, "tune_call", lambda call, *a: tuned.append(call) or {})  # no timing here

  def fn(feats, w):
    y = jsparse.submconv3d(x.replace(feats=feats), w, implementation="pallas")
    return jsparse.submconv3d(y, w[..., :2], implementation="pallas").feats

  jsparse.autotune(fn, x.feats, w, warmup=0, repeats=1)
  bars = [b for b in fake_tqdm.made if b.kwargs["desc"] == "autotune"]
  assert len(bars) == 1 and len(bars[0].seen) == 2 and len(tuned) == 2
  assert [c.cout for c in bars[0].seen] == [4, 2]


def test_benchmark_suite_shows_a_bar_over_its_workloads(fake_tqdm, tmp_path):
  from benchmarks import suite
  assert suite.main(["--smoke", "--dtypes", "fp32", "--out", str(tmp_path)]) == 0
  (bar,) = [b for b in fake_tqdm.made if b.kwargs["desc"] == "suite"]
  assert [(d, m, r.name) for d, m, r in bar.seen] == [("fp32", m, suite.SMOKE_ROW.name)
                                                       for m in ("inference", "train")]
