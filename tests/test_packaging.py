"""The package as a user meets it: metadata, typing marker, the API reference, and README snippets that run."""
import importlib.util
import os
import subprocess
import sys
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
