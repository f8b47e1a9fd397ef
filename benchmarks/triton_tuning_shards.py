"""Splits an anchor's Triton autotuning across processes that run the same workload.

spconv-triton autotunes every kernel shape on its first calls, and most of that time is one CPU core compiling
the ~40 candidate configurations of each shape: MinkUNet's TF32 kernels alone took more than a 10-minute call.
`share_triton_autotuning(shard, shards)` makes a process benchmark only the tuning keys it owns (a stable hash of
the kernel's name and key; every process computes the same split) and write those results to Triton's on-disk
autotune cache (`TRITON_CACHE_DIR`). For any other key it takes a result already on disk or, lacking one, runs
the first candidate untimed and records nothing. So `shards` processes tune a workload's keys once between them,
in parallel, and a later process without sharding finds every result on disk. The untimed kernels only make a
shard's own run slower; no result is ever written from them. Used by `scripts/warm_spconv_triton.sh`.

Two limits: Triton never caches a kernel whose configurations carry pre-hooks (spconv-triton 1.0 has none), so
such a kernel is tuned afresh by every process that is not sharded; and a first candidate that cannot run (e.g.
out of shared memory) stops the shard that ran it untimed, leaving its own keys untuned: run again with another
N to spread what is left.
"""

from __future__ import annotations

import zlib


def owns(kernel_name: str, tuning_key, shard: int, shards: int) -> bool:
  """Whether `shard` of `shards` tunes this kernel's key (crc32: the same answer in every process)."""
  return zlib.crc32(f"{kernel_name}|{tuning_key!r}".encode()) % shards == shard


def parse_shard(text: str) -> tuple[int, int]:
  """'I/N' -> (I, N), with 0 <= I < N."""
  try:
    shard, shards = (int(t) for t in text.split("/"))
  except ValueError:
    raise ValueError(f"tune shard must be 'I/N' with integers, got {text!r}") from None
  if not 0 <= shard < shards:
    raise ValueError(f"tune shard {text!r}: need 0 <= I < N")
  return shard, shards


class _NotThisShards(Exception):
  """Raised in place of a benchmark for a key another shard tunes."""


def share_triton_autotuning(shard: int, shards: int, autotuner_cls=None) -> None:
  """From now on this process tunes only its share of Triton's autotuning keys (see the module's docstring).

  autotuner_cls: the class to patch (tests pass a stand-in); default `triton.runtime.autotuner.Autotuner`, whose
  `check_disk_cache(self, tuning_key, configs, bench_fn)` reads a result from disk or calls `bench_fn` and writes
  its timings."""
  if not (isinstance(shard, int) and isinstance(shards, int) and 0 <= shard < shards):
    raise ValueError(f"need integers 0 <= shard < shards, got shard={shard!r}, shards={shards!r}")
  if autotuner_cls is None:
    from triton.runtime.autotuner import Autotuner as autotuner_cls
  original = autotuner_cls.check_disk_cache

  def check_disk_cache(self, tuning_key, configs, bench_fn):
    if not tuning_key or owns(self.base_fn.__name__, tuning_key, shard, shards):
      return original(self, tuning_key, configs, bench_fn)

    def refuse():
      raise _NotThisShards

    try:  # the original writes to disk only after bench_fn returns, so refusing writes nothing
      return original(self, tuning_key, configs, refuse)
    except _NotThisShards:
      self.cache[tuning_key] = configs[0]
      self.configs_timings = {configs[0]: [float("inf")] * 3}
      return True

  autotuner_cls.check_disk_cache = check_disk_cache
