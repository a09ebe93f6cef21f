"""The one reader of controlplane's environment: flags, numbers and the rank variables."""

from __future__ import annotations

import pytest

from controlplane import _config


@pytest.mark.parametrize("value", ["1", "true", "TRUE", " yes ", "On"])
def test_flag_true_spellings(value: str) -> None:
    assert _config.env_flag("F", {"F": value}) is True


@pytest.mark.parametrize("value", ["0", "false", "No", "off", ""])
def test_flag_false_spellings(value: str) -> None:
    assert _config.env_flag("F", {"F": value}) is False


def test_unset_flag_is_false_and_a_typo_is_an_error() -> None:
    assert _config.env_flag("F", {}) is False
    with pytest.raises(ValueError, match="F='ture' is not a flag"):
        _config.env_flag("F", {"F": "ture"})


def test_either_auto_padding_switch_turns_it_on() -> None:
    assert not _config.auto_padding_enabled({})
    assert _config.auto_padding_enabled({"VERL_AUTO_PADDING": "0", "CONTROLPLANE_AUTO_PADDING": "1"})
    assert _config.auto_padding_enabled({"VERL_AUTO_PADDING": "True"})


def test_auto_padding_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONTROLPLANE_AUTO_PADDING", raising=False)
    monkeypatch.setenv("VERL_AUTO_PADDING", "1")
    assert _config.auto_padding_enabled()
    monkeypatch.setenv("VERL_AUTO_PADDING", "maybe")
    with pytest.raises(ValueError, match="VERL_AUTO_PADDING"):
        _config.auto_padding_enabled()


def test_future_timeout() -> None:
    assert _config.future_timeout_s({}) == _config.DEFAULT_FUTURE_TIMEOUT_S
    assert _config.future_timeout_s({"CONTROLPLANE_FUTURE_TIMEOUT_S": "2.5"}) == 2.5
    for bad in ("soon", "0", "-1", "nan"):
        with pytest.raises(ValueError, match="CONTROLPLANE_FUTURE_TIMEOUT_S"):
            _config.future_timeout_s({"CONTROLPLANE_FUTURE_TIMEOUT_S": bad})


def test_rank_info_defaults_outside_a_group() -> None:
    assert _config.rank_info({}) == (1, 0, 1, 0, None, None)


def test_rank_info_from_the_group_environment() -> None:
    env = {
        "WORLD_SIZE": "4",
        "RANK": "3",
        "LOCAL_WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    assert _config.rank_info(env) == (4, 3, 2, 1, "10.0.0.1", "29500")


def test_rank_info_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="WORLD_SIZE='four' is not an int"):
        _config.rank_info({"WORLD_SIZE": "four"})
    with pytest.raises(ValueError, match="RANK=4 is outside WORLD_SIZE=4"):
        _config.rank_info({"WORLD_SIZE": "4", "RANK": "4"})
