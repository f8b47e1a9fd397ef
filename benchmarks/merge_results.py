"""Append one benchmark run's output files to a GPU's merged results file (benchmarks/results/<gpu>.json).

    python -m benchmarks.merge_results --into benchmarks/results/h100.json OUT/suite.json OUT/suite.md \
        [OUT/suite.log ...] [--what "fp16 suite, tuned"] [--date 2026-11-24] [--commit abc1234]

The merged file is {"runs": [...]}, oldest first; a run is {"date", "commit", "what", "files": {name: content}}
with JSON files stored parsed and text files (markdown, logs) as strings. Charts are not stored: the suite
redraws them from its JSON (`python -m benchmarks.suite --report`). Date and commit default to the first JSON
file's `meta` (what the suite, kernels and networks benchmarks record); a run with the same date and file
names as one already there replaces it, so merging twice changes nothing.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
from typing import Any

TEXT_SUFFIXES = (".md", ".log", ".txt")


def read_output(path: str) -> Any:
  """A result file's content: parsed JSON, or the text of a markdown or log file."""
  with open(path) as f:
    if path.endswith(".json"):
      return json.load(f)
    if path.endswith(TEXT_SUFFIXES):
      return f.read()
  raise ValueError(f"path must be a .json, .md, .log or .txt result file, got {path!r}")


def make_run(paths: list[str], *, what: str | None = None, date: str | None = None,
             commit: str | None = None) -> dict:
  """One run record from its output files; date and commit from the first JSON file's meta unless given."""
  if not paths:
    raise ValueError("paths must name at least one result file")
  files = {os.path.basename(p): read_output(p) for p in paths}
  if len(files) != len(paths):
    raise ValueError(f"paths must have distinct file names, got {paths}")
  meta = next((c.get("meta", {}) for c in files.values() if isinstance(c, dict) and "meta" in c), {})
  date = date or str(meta.get("date", ""))[:10] or datetime.date.today().isoformat()
  commit = commit or meta.get("commit")
  return {"date": date, "commit": commit, "what": what or ", ".join(files), "files": files}


def merge_run(merged_path: str, run: dict) -> dict:
  """Adds `run` to the merged file at merged_path (created if missing), replacing a run of the same date and
  file names; runs stay sorted by date. Returns the merged data as written."""
  data = {"runs": []}
  if os.path.exists(merged_path):
    with open(merged_path) as f:
      data = json.load(f)
  same = lambda r: r["date"] == run["date"] and sorted(r["files"]) == sorted(run["files"])  # noqa: E731
  data["runs"] = sorted([r for r in data["runs"] if not same(r)] + [run], key=lambda r: r["date"])
  tmp = merged_path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1)
    f.write("\n")
  os.replace(tmp, merged_path)
  return data


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("files", nargs="+", help="the run's output files (.json, .md, .log, .txt)")
  ap.add_argument("--into", required=True, help="the merged file, e.g. benchmarks/results/h100.json")
  ap.add_argument("--what", help="what the run measured (default: its file names)")
  ap.add_argument("--date", help="YYYY-MM-DD (default: the JSON meta's date, else today)")
  ap.add_argument("--commit", help="commit measured (default: the JSON meta's commit)")
  args = ap.parse_args(argv)
  run = make_run(args.files, what=args.what, date=args.date, commit=args.commit)
  data = merge_run(args.into, run)
  print(f"{args.into}: {len(data['runs'])} runs; added {run['date']} {run['what']!r}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
