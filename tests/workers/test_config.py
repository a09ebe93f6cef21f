"""``rlplane demo``'s flags and ``--resume``'s checkpoint, checked before anything starts
(``workers.config``): errors name the flags a user typed, the Python API keeps ``TrainerConfig``'s
names, ``--resume`` selects stream mode, and a checkpoint that is missing, incomplete, of other
settings or already past ``--steps`` is refused naming the directory. Files only: no Ray here
(``tests/rlplane/test_cli.py`` checks that the command answers these without loading torch or Ray).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from rlplane.cli import build_parser
from workers.checkpoints import ResumeError
from workers.config import TrainerConfig, demo_uses_gpu, from_demo_args


def _configs(*argv: str) -> dict[str, TrainerConfig]:
    return from_demo_args(build_parser().parse_args(["demo", *argv]))


def _checkpoint(root: pathlib.Path, step: int = 4, **settings: object) -> pathlib.Path:
    """A checkpoint's files as the trainer writes them (``workers.checkpoints``), contents aside:
    the check reads ``latest``, the trainer state and which parts exist."""
    cfg = TrainerConfig(mode="stream", checkpoint_dir=str(root), checkpoint_every=2, **settings)  # type: ignore[arg-type]
    where = root / f"step-{step}"
    (where / "store").mkdir(parents=True)
    (where / "actor.pt").write_bytes(b"")
    (where / "store" / "manifest.json").write_text("{}")
    state = {"version": 1, "run": 1, "step": step, "settings": dataclasses.asdict(cfg)}
    (where / "trainer.json").write_text(json.dumps(state))
    (root / "latest").write_text(f"step-{step}\n")
    return where


# What a user types -> what the one line says: the flags, never TrainerConfig's field names.
FLAG_ERRORS = [
    (("--checkpoint-every", "2"), "--checkpoint-every needs --checkpoint-dir to save into"),
    (("--mode", "sync", "--resume", "x"), "--resume is for stream mode, not --mode sync: leave --mode out"),
    (
        ("--mode", "both", "--checkpoint-dir", "x", "--checkpoint-every", "2"),
        "--checkpoint-dir, --checkpoint-every are for stream mode, not --mode both",
    ),
    (
        ("--mode", "stream", "--stream-chunks", "3"),
        "prompts_per_step=16 must divide into --stream-chunks 3 chunks of whole groups",
    ),
    (("--mode", "stream", "--dp", "3"), "must divide into --rollout-chunks 1 calls on each of --dp 3 ranks"),
    (
        ("--mode", "stream", "--dp", "16", "--stream-chunks", "16", "--colocate"),
        "stream mode with --colocate: the 8 rows of a reward batch must divide over the --dp 16 ranks",
    ),
]


@pytest.mark.parametrize("argv, said", FLAG_ERRORS)
def test_demo_flag_errors_name_the_flags(argv: tuple[str, ...], said: str) -> None:
    with pytest.raises(ValueError) as err:
        _configs(*argv)
    assert said in str(err.value)
    assert "TrainerConfig" not in str(err.value) and "_" not in str(err.value).replace("prompts_per_step", "")


def test_python_callers_still_see_the_config_names() -> None:
    with pytest.raises(
        ValueError, match=r"^TrainerConfig.checkpoint_every needs TrainerConfig.checkpoint_dir"
    ):
        TrainerConfig(mode="stream", checkpoint_every=2)
    with pytest.raises(ValueError, match=r"stream_chunks=3 chunks"):
        TrainerConfig(mode="stream", stream_chunks=3)
    with pytest.raises(ValueError, match=r"\(mode='stream'\)"):
        TrainerConfig(resume="x")
    cfg = TrainerConfig(source="cli")
    assert cfg == TrainerConfig() and "source" not in dataclasses.asdict(cfg)  # not a setting


def test_checkpoint_flags_select_stream_mode(tmp_path: pathlib.Path) -> None:
    _checkpoint(tmp_path)
    assert list(_configs()) == ["sync"] and list(_configs("--mode", "both")) == ["sync", "stream"]
    (cfg,) = _configs("--resume", str(tmp_path)).values()
    assert cfg.mode == "stream" and cfg.resume == str(tmp_path)
    (cfg,) = _configs("--checkpoint-dir", str(tmp_path / "new"), "--checkpoint-every", "2").values()
    assert cfg.mode == "stream"


def test_resume_refuses_what_it_cannot_resume_naming_the_directory(tmp_path: pathlib.Path) -> None:
    missing, afile, empty = tmp_path / "no" / "such", tmp_path / "file", tmp_path / "empty"
    afile.write_text("")
    empty.mkdir()
    incomplete = tmp_path / "incomplete"
    (_checkpoint(incomplete) / "actor.pt").unlink()
    torn = tmp_path / "torn"
    (_checkpoint(torn) / "trainer.json").write_text('{"version": 1, "st')
    cases = {
        missing: f"--resume {missing}: no such directory",
        afile: f"--resume {afile}: not a directory",
        empty: f"--resume {empty}: no complete trainer checkpoint in it (no latest file)",
        incomplete: f"--resume {incomplete}: the newest checkpoint, step-4, is incomplete: actor.pt missing",
        torn: f"--resume {torn}: the newest checkpoint, step-4, has no readable trainer.json",
    }
    for root, said in cases.items():
        with pytest.raises(ResumeError) as err:
            _configs("--resume", str(root))
        assert str(err.value).startswith(said), str(err.value)
        assert "\n" not in str(err.value)
    with pytest.raises(ResumeError) as err:  # the Python API: the same, without the flag
        TrainerConfig(mode="stream", resume=str(missing)).check_resume()
    assert str(err.value) == f"{missing}: no such directory"


def test_resume_refuses_other_settings_and_a_run_with_nothing_left(tmp_path: pathlib.Path) -> None:
    where = _checkpoint(tmp_path, step=4)
    with pytest.raises(ResumeError, match=r"--dp 1 \(checkpoint: 2\), --seed 3 \(checkpoint: 0\)") as err:
        _configs("--resume", str(tmp_path), "--dp", "1", "--seed", "3")
    assert str(where) in str(err.value)
    with pytest.raises(ResumeError, match=r"saved after 4 steps, so --steps 4 leaves none to train"):
        _configs("--resume", str(tmp_path), "--steps", "4")
    with pytest.raises(ResumeError, match=r"dp=1 \(checkpoint: 2\)"):
        TrainerConfig(mode="stream", dp=1, resume=str(tmp_path)).check_resume()
    (cfg,) = _configs("--resume", str(tmp_path), "--steps", "5").values()
    assert cfg.check_resume()[0] == where


def test_the_demo_takes_the_gpus_when_there_is_one_per_rank() -> None:
    assert build_parser().parse_args(["demo"]).device == "auto"
    assert demo_uses_gpu("auto", 0, 1) is False  # no GPU: the CPU, as always
    assert demo_uses_gpu("auto", 1, 2) is False  # one GPU, two ranks: NCCL takes one device per rank
    assert demo_uses_gpu("auto", 2, 2) is True
    assert demo_uses_gpu("cuda", 4, 2) is True
    assert demo_uses_gpu("cpu", 4, 2) is False
    with pytest.raises(
        ValueError,
        match=r"--device cuda needs a GPU per actor rank \(--dp 2\); the Ray cluster has 1: give --dp 1",
    ):
        demo_uses_gpu("cuda", 1, 2)
    with pytest.raises(ValueError, match="the Ray cluster has none"):
        demo_uses_gpu("cuda", 0, 1)
    with pytest.raises(ValueError, match="--device must be one of"):
        demo_uses_gpu("tpu", 1, 1)
