"""Host memory: keep the memory XLA:CPU frees in the process instead of unmapping it.

XLA:CPU takes each call's buffers (its outputs and one temporary buffer sized by the program's
live intermediates) from the C allocator and frees them when the call ends. With glibc's
defaults, an allocation above the mmap threshold (128 KiB at first, adapting up to 32 MiB) is a
fresh mapping, unmapped again when freed, so every call touches new pages, a page fault per
4 KiB; for a step whose buffers reach tens of MB (the server's step over a few of its slots
gathers each row's cache) that costs as much as the arithmetic. Raising the mmap and trim
thresholds lets freed memory be reused: the process keeps its peak host memory instead of
returning it, as jemalloc or tcmalloc would. Not covered: a buffer over 64 MiB requested from a
thread other than the main one (glibc's other arenas hold at most 64 MiB per heap) is still
mapped; serving every thread from the main arena (``M_ARENA_MAX`` 1) would cover it but slowed
small steps (results/linux-x86-64-2cpu/2026-11-26-smaller-trees).

``keep_freed_memory()`` does that through glibc's ``mallopt``; the commands call it first
(``cli.main``, ``python -m redrafter_jax.bench``), and a program of one's own can call it before
its first JAX computation. Elsewhere (not glibc) it does nothing. ``REDRAFTER_JAX_MALLOC=default``
keeps glibc's settings (for comparisons).

The other side: ``release_free_memory()`` hands what is free back to the OS at chosen moments
(the server after each compile), and ``status_kb`` / ``memory_mappings`` read what a process
holds (Linux ``/proc``), for logs, benches and the server's mapping budget.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

ENV = "REDRAFTER_JAX_MALLOC"
# mallopt parameters (glibc's malloc.h) and the values set.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = ((_M_MMAP_THRESHOLD, 1 << 30),  # below 1 GiB: from the heap, not a new mapping
            (_M_TRIM_THRESHOLD, 1 << 31),  # keep up to 2 GiB freed at the heap's top
            (_M_TOP_PAD, 64 << 20))  # and grow it 64 MiB at a time

_applied: bool | None = None
_libc: ctypes.CDLL | None | bool = False  # False: not looked up yet


def libc() -> ctypes.CDLL | None:
  """The C library (looked up once), or None where there is none to find."""
  global _libc
  if _libc is False:
    name = ctypes.util.find_library("c")
    try:
      _libc = ctypes.CDLL(name) if name else None
    except OSError:
      _libc = None
  return _libc


def keep_freed_memory() -> bool:
  """Apply ``SETTINGS`` once per process; True when glibc took them all. False where there is
  no glibc ``mallopt`` or ``REDRAFTER_JAX_MALLOC=default``; calling again changes nothing."""
  global _applied
  if _applied is None:
    _applied = False
    if os.environ.get(ENV, "").strip().lower() != "default":
      c = libc()
      if c is not None and hasattr(c, "mallopt") and hasattr(c, "gnu_get_libc_version"):
        _applied = all(c.mallopt(param, value) == 1 for param, value in SETTINGS)
  return _applied


def release_free_memory() -> None:
  """Hand the memory the C allocator holds free back to the OS (glibc's ``malloc_trim``; a
  no-op elsewhere). XLA:CPU's compiles and runs free what they used, but glibc keeps it (in
  per-thread arenas, and below the thresholds above), so a server compiling on one thread
  while its engine runs on another grows with every program it takes into use."""
  c = libc()
  if c is not None and hasattr(c, "malloc_trim"):
    c.malloc_trim(0)


def status_kb(pid: int | str = "self", keys=("VmRSS", "VmHWM")) -> dict[str, int]:
  """``keys`` of a process's ``/proc/<pid>/status`` in kB (default: resident memory and its
  peak); empty when the process is gone or there is no ``/proc``."""
  try:
    with open(f"/proc/{pid}/status") as f:
      lines = f.read().splitlines()
  except OSError:
    return {}
  out = {}
  for line in lines:
    key, _, value = line.partition(":")
    if key in keys:
      out[key] = int(value.split()[0])
  return out


def resident_bytes() -> int | None:
  """This process's resident memory in bytes (``VmRSS``), on Linux; None elsewhere."""
  kb = status_kb(keys=("VmRSS",)).get("VmRSS")
  return None if kb is None else kb * 1024


def memory_mappings() -> tuple[int, int] | None:
  """The memory mappings this process holds and the kernel's limit per process
  (``vm.max_map_count``), on Linux; None elsewhere."""
  try:
    with open("/proc/self/maps", "rb") as f:
      held = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
      return held, int(f.read())
  except (OSError, ValueError):
    return None
