"""worker/faults.py in process: the spec parser and the injector's counting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker import faults
from worker.faults import FaultInjector, FaultRule, FaultSpecError, parse_faults


def test_parse_faults() -> None:
    assert parse_faults("") == ()
    assert parse_faults("oom:3") == (FaultRule("oom", "forward", 3, 3),)
    assert parse_faults("sleep@forward:*:0.25, exit@forward:2-4") == (
        FaultRule("sleep", "forward", 0, 0, 0.25),
        FaultRule("exit", "forward", 2, 4),
    )
    for bad in ("oom", "boom:1", "oom:0", "oom:x", "oom:3-1", "sleep:1:fast", "oom:1:2:3"):
        with pytest.raises(FaultSpecError):
            parse_faults(bad)


def test_oom_on_the_chosen_hits_only() -> None:
    injector = FaultInjector(parse_faults("oom:2,oom:4-5"))
    outcomes = []
    for _ in range(6):
        try:
            injector.inject("forward")
            outcomes.append("ok")
        except torch.OutOfMemoryError:
            outcomes.append("oom")
    assert outcomes == ["ok", "oom", "ok", "oom", "oom", "ok"]
    injector.inject("elsewhere")  # another point has its own count and no rule
    assert injector.hits == {"forward": 6, "elsewhere": 1}


def test_no_spec_is_a_no_op() -> None:
    injector = FaultInjector(())
    for _ in range(3):
        injector.inject("forward")
    assert not injector.hits


def test_armed_file_is_taken_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arm = tmp_path / "arm"
    monkeypatch.setenv(faults.ENV, "")
    monkeypatch.setenv(faults.FILE_ENV, str(arm))
    monkeypatch.setattr(faults, "_injector", None)
    faults.maybe_inject("forward")  # nothing armed
    arm.write_text("oom:2")
    faults.maybe_inject("forward")  # takes the file: hit 1 of the armed rules
    assert not arm.exists()
    with pytest.raises(torch.OutOfMemoryError):
        faults.maybe_inject("forward")
    faults.maybe_inject("forward")
    monkeypatch.setattr(faults, "_injector", None)


def test_faulty_model_hits_before_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    monkeypatch.setattr(faults, "_injector", FaultInjector(parse_faults("oom:2")))
    monkeypatch.setattr(faults, "_arm_path", None)
    model = faults.FaultyModel(Model())
    assert model(torch.zeros(1)).item() == 1
    assert model.training  # attributes are the model's
    with pytest.raises(torch.OutOfMemoryError):
        model(torch.zeros(1))
    assert model(torch.zeros(1)).item() == 1
