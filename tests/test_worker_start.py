"""The session clusters' worker launcher (``tests/_worker_start.py``) starts workers as Ray's own does."""

from __future__ import annotations

import os
import sys

import pytest

from tests._worker_start import split


def test_split_reads_the_context_and_language_in_both_spellings() -> None:
    ctx = '{"env_vars": {"A": "1"}}'
    for argv in (
        [f"--serialized-runtime-env-context={ctx}", "worker.py", "--language=PYTHON", "--x=1"],
        ["--serialized-runtime-env-context", ctx, "worker.py", "--language", "PYTHON", "--x=1"],
    ):
        assert split(argv) == ({"env_vars": {"A": "1"}}, "PYTHON", ["worker.py", "--x=1"])
    assert split(["worker.py"]) == ({}, "", ["worker.py"])


def _probe() -> tuple:
    return os.environ.get("A"), os.environ.get("B"), sys.flags.utf8_mode


@pytest.mark.ray
def test_env_vars_expand_as_ray_expands_them_and_other_contexts_go_to_rays_script(ray_session) -> None:
    import ray

    probe = ray.remote(num_cpus=0.01)(_probe)
    env = {"A": "${HOME}/x", "B": "${RLPLANE_NOT_SET}y"}
    got = ray.get(probe.options(runtime_env={"env_vars": env}).remote(), timeout=120)
    assert got == (f"{os.environ['HOME']}/x", "y", 0)
    # An interpreter given as a command line is Ray's script's to run (through bash): it still applies.
    command = {"py_executable": f"{sys.executable} -X utf8"}
    assert ray.get(probe.options(runtime_env=command).remote(), timeout=120)[2] == 1
