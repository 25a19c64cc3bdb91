"""``hostmem.keep_freed_memory``: glibc takes the settings once per process; the env opts out.
Each case runs in a fresh interpreter (the settings are process-wide)."""

import os
import platform
import subprocess
import sys

import pytest

CODE = ("from redrafter_jax.hostmem import keep_freed_memory as k; "
        "import redrafter_jax.hostmem as h; print(k(), k(), h._applied)")


def run(setting=None):
  env = {k: v for k, v in os.environ.items() if k != "REDRAFTER_JAX_MALLOC"}
  if setting is not None:
    env["REDRAFTER_JAX_MALLOC"] = setting
  return subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True,
                        check=True).stdout.split()


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="mallopt is glibc's")
def test_glibc_takes_the_settings():
  assert run() == ["True", "True", "True"]


def test_default_keeps_the_allocators_settings():
  assert run("default") == ["False", "False", "False"]
  assert run(" Default ") == ["False", "False", "False"]


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc")
def test_status_and_mappings_of_this_process():
  from redrafter_jax import hostmem

  mem = hostmem.status_kb(os.getpid())
  assert mem["VmRSS"] > 0 and mem["VmHWM"] >= mem["VmRSS"]
  assert hostmem.status_kb().keys() == mem.keys()
  assert hostmem.status_kb(2 ** 22 + 12345) == {}  # no such process
  held, limit = hostmem.memory_mappings()
  assert 0 < held < limit


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="malloc_trim is glibc's")
def test_release_free_memory_gives_freed_memory_back():
  """Memory freed below the kept thresholds (``keep_freed_memory``) stays resident until
  ``release_free_memory``; measured in a fresh interpreter with the settings applied."""
  code = ("import redrafter_jax.hostmem as h; h.keep_freed_memory(); "
          "rss = lambda: h.status_kb()['VmRSS']; "
          "b = [bytearray(1 << 20) for _ in range(200)]; full = rss(); del b; kept = rss(); "
          "h.release_free_memory(); print(full, kept, rss())")
  full, kept, released = map(int, subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
  assert kept > full - 50_000  # 200 MB freed, still held
  assert released < kept - 150_000  # handed back
