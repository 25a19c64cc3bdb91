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
