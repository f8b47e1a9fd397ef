"""The package as a user meets it: metadata, typing marker, the API reference, and README snippets that run."""
import importlib.util
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_snippet(heading: str) -> str:
  """The first ```python block after the README line `heading`."""
  text = (ROOT / "README.md").read_text()
  start = text.index("```python\n", text.index(f"\n{heading}\n")) + len("```python\n")
  return text[start:text.index("\n```\n", start) + 1]


def run_snippet(code: str, tmp_path: Path, env_extra: dict | None = None) -> None:
  script = tmp_path / "snippet.py"
  script.write_text(code)
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env_extra or {}))
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_metadata():
  meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
  project = meta["project"]
  assert project["license"] == "Apache-2.0"
  assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
  assert "jax>=0.11.2,<0.12" in project["dependencies"]
  assert {"cuda", "plot", "docs", "dev", "test"} <= set(project["optional-dependencies"])
  data = meta["tool"]["setuptools"]["package-data"]
  for package in ("jsparse", "pallas_kernels"):
    assert (ROOT / package / "py.typed").exists() and "py.typed" in data[package], package
  assert (ROOT / "CHANGELOG.md").exists()


def test_api_reference():
  """docs/build_api.py --check: every public name has a docstring, every `jsparse.x.y` reference resolves, and
  docs/api.md lists the names the code has (regenerate it with `python docs/build_api.py`)."""
  spec = importlib.util.spec_from_file_location("build_api", ROOT / "docs" / "build_api.py")
  build_api = importlib.util.module_from_spec(spec)
  sys.modules["build_api"] = build_api  # dataclasses look their module up there
  spec.loader.exec_module(build_api)
  sections = build_api.collect()
  assert build_api.problems(sections) == []
  documented = {e.name for _, entries in sections for e in entries}
  import jsparse
  for name in jsparse.__all__:
    assert f"jsparse.{name}" in documented or getattr(jsparse, name).__name__ == f"jsparse.{name}", name
  assert build_api.main(["--check"]) == 0
  assert not build_api.resolve("jsparse.no_such_name") and build_api.resolve("jsparse.nn.SubMConv3d")


def test_public_api_is_annotated():
  import inspect

  import jsparse
  for name in jsparse.__all__:
    obj = getattr(jsparse, name)
    if inspect.isfunction(obj):
      sig = inspect.signature(obj)
      missing = [p for p, v in sig.parameters.items() if v.annotation is inspect.Parameter.empty]
      assert not missing and sig.return_annotation is not inspect.Parameter.empty, (name, missing)


def test_readme_data_parallel_snippet(tmp_path):
  """The README's data-parallel example, as written, on two CPU devices."""
  run_snippet(readme_snippet("### Data-parallel training"), tmp_path,
              {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2",
               "JAX_PLATFORMS": "cpu"})


def test_readme_checkpoint_snippet(tmp_path):
  """The README's orbax example saves and restores a jsparse.nn model's variables."""
  pytest.importorskip("orbax.checkpoint")
  code = readme_snippet("### Checkpoints") + (
      "\nassert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), variables, restored))\n"
      "assert y.feats.shape == (x.capacity, 16)\nprint('OK')\n")
  run_snippet(code, tmp_path, {"JAX_PLATFORMS": "cpu"})


def test_ruff_is_clean():
  # ruff comes with the test extra (the GPU image, which runs the suite too, has no ruff); pyproject's [tool.ruff]
  # says what is checked.
  pytest.importorskip("ruff")
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", root],
                       capture_output=True, text=True, cwd=root)
  assert run.returncode == 0, run.stdout + run.stderr


def test_gpu_test_deps_copies_importable_packages_and_the_xdist_plugin(tmp_path):
  """`make gpu-test-deps`'s copy works without the venv: from the copy alone (no site-packages: -S), hypothesis
  and execnet import, and pytest would find the xdist plugin through its entry point."""
  dest = tmp_path / "deps"
  subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_test_deps.py"), str(dest)], check=True,
                 capture_output=True)
  code = ("import sys; sys.path.insert(0, sys.argv[1]); import execnet, hypothesis, importlib.metadata as m; "
          "print(hypothesis.__file__); "
          "print(*sorted(e.name for d in m.distributions(path=[sys.argv[1]]) for e in d.entry_points "
          "if e.group == 'pytest11'))")
  out = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(dest)], check=True, capture_output=True,
                       text=True).stdout.splitlines()
  assert out[0].startswith(str(dest)) and "xdist" in out[1].split()


def test_readme_quickstart_and_networks_snippets():
  """The README's Quickstart and linen Networks examples run as written, with the shapes their comments state."""
  scope: dict = {}
  exec(compile(readme_snippet("## Quickstart"), "README.md", "exec"), scope)
  x, y, dense, grads, w = (scope[k] for k in ("x", "y", "dense", "grads", "w"))
  assert y.feats.shape == (x.capacity, 32) and dense.shape == (1, 8, 8, 8, 32) and grads.shape == w.shape
  exec(compile(readme_snippet("### Networks (flax.linen)"), "README.md", "exec"), scope)
  import jax
  net = scope["Net"]()
  variables = jax.jit(net.init)(jax.random.key(0), x)
  out, _ = net.apply(variables, x, mutable=["batch_stats"])
  assert out.feats.shape == (x.capacity, 1)


def test_architecture_new_algorithm_example():
  """docs/architecture.md's "Adding a new GEMM algorithm" example: its config class, registered as the doc says
  (the kernel stubbed by the implicit GEMM's), is accepted by a convolution and runs every pass."""
  import re

  import jax
  import jax.numpy as jnp
  import numpy as np

  import jsparse
  from jsparse import pass_config
  from pallas_kernels import gather_gemm_config, weight_grad
  from pallas_kernels.tiling import TileConfig

  text = (ROOT / "docs" / "architecture.md").read_text()
  blocks = [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)\n *```", text, re.S)]
  config_class, registry_line = blocks

  class sorted_gemm:  # the new kernel's module, stubbed
    @staticmethod
    def run(pass_name, inputs, tiles, options):
      return pass_config.Implicit(tiles).run(pass_name, inputs, options)

  scope = dict(dataclasses=__import__("dataclasses"), ClassVar=__import__("typing").ClassVar,
               TileConfig=TileConfig, weight_grad=weight_grad, sorted_gemm=sorted_gemm,
               default_config=gather_gemm_config.default_config,
               candidates=lambda rows, cin, cout, dtype: [gather_gemm_config.default_config(rows, cin, cout, dtype)])
  exec(compile(config_class, "docs/architecture.md", "exec"), scope)
  registry_scope = dict(vars(pass_config), sorted_gemm_config=type("m", (), {"Sorted": scope["Sorted"]}))
  exec(compile(registry_line, "docs/architecture.md", "exec"), registry_scope)
  saved = dict(pass_config.REGISTRY)
  try:
    pass_config.REGISTRY.clear()
    pass_config.REGISTRY.update(registry_scope["REGISTRY"])
    assert set(saved) < set(pass_config.REGISTRY)
    coords = np.array([[0, 1, 2, 3], [0, 1, 2, 4], [0, 2, 2, 4]], np.int32)
    x = jsparse.SparseTensor.from_coords(coords, np.ones((3, 4), np.float32), (8, 8, 8), capacity=128)
    w = jnp.ones((3, 3, 3, 4, 8)) * 0.1
    conv = lambda w, algorithm: jsparse.submconv3d(x, w, algorithm=algorithm, implementation="pallas")
    loss = lambda w, algorithm: jnp.sum(conv(w, algorithm).feats ** 2)
    np.testing.assert_allclose(jax.grad(loss)(w, "sorted"), jax.grad(loss)(w, "implicit"), rtol=1e-5)
  finally:
    pass_config.REGISTRY.clear()
    pass_config.REGISTRY.update(saved)
