"""docs/smp_v1_api.md against the code: every refused name raises what the table says to
use instead; the SMP loss scalers, the no-effect keywords, the smp.nn names and the
@smp.step splitting, without a process group."""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path

import pytest
import torch

import smsdp as smp
from smsdp.smp.loss_scale_args import StaticLossScaler, dynamic_scaler, scaler_for
from smsdp.smp.model_args import check_no_effect_kwargs
from smsdp.smp.model_methods import SMPModelMethods
from smsdp.smp.step import _split

TABLE = Path(__file__).resolve().parents[2] / "docs" / "smp_v1_api.md"


def refused_rows() -> list[tuple[str, str]]:
    rows = []
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] == "refused":
            for name in re.findall(r"`([A-Za-z_.]+)", cells[0]):
                rows.append((name, cells[2].split("; ")[-1]))
    return rows


def call_refused(name: str) -> None:
    if name == "register_comm_hook":
        SMPModelMethods.register_comm_hook(None)
    target = smp
    for part in name.split("."):
        target = getattr(target, part)
    target()


def test_the_table_lists_refused_names():
    names = [name for name, _ in refused_rows()]
    assert {  # tensor_parallelism was refused until issue 25: it is supported now
        "partition",
        "register_comm_hook",
        "optimizers.FusedLamb",
        "nn.DistributedTransformerLMHead",
    } <= set(names)


@pytest.mark.parametrize("name, use_instead", refused_rows())
def test_every_refused_name_raises_what_the_table_says(name, use_instead):
    with pytest.raises(NotImplementedError) as info:
        call_refused(name)
    assert use_instead in str(info.value)
    assert "not supported by smsdp" in str(info.value) or "smsdp has none" in str(info.value)


def test_unknown_names_stay_attribute_errors():
    with pytest.raises(AttributeError):
        smp.no_such_function


def test_fused_layer_norm_is_a_layer_norm_and_tp_names_resolve():
    assert isinstance(smp.nn.FusedLayerNorm(8), torch.nn.LayerNorm)
    assert not isinstance(torch.nn.Linear(2, 2), smp.nn.DistributedLinear)


def test_no_effect_keywords_are_logged_once_and_unknown_ones_refused(caplog):
    with caplog.at_level(logging.INFO, logger="smsdp"):
        check_no_effect_kwargs({"trace_device": "gpu"})
        check_no_effect_kwargs({"trace_device": "gpu"})
    assert len([r for r in caplog.records if "trace_device" in r.getMessage()]) <= 1
    with pytest.raises(TypeError, match="trace_devise"):
        check_no_effect_kwargs({"trace_devise": "gpu"})


def test_dynamic_loss_args_follow_smp_including_the_hysteresis():
    scaler = dynamic_scaler({"init_scale": 1024, "scale_window": 2, "delayed_shift": 2, "min_scale": 256})
    scaler.update(overflow=True)
    assert scaler.scale == 1024  # the first overflow is tolerated (delayed_shift=2)
    scaler.update(overflow=True)
    assert scaler.scale == 512
    scaler.update(overflow=True)
    assert scaler.scale == 256
    scaler.update(overflow=True)
    assert scaler.scale == 256  # min_scale
    scaler.update(overflow=False)
    scaler.update(overflow=False)
    assert scaler.scale == 512  # scale_window clean steps
    restored = dynamic_scaler({"delayed_shift": 2})
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    assert dynamic_scaler(None).scale == 2.0**32
    with pytest.raises(ValueError, match="scale_windw"):
        dynamic_scaler({"scale_windw": 3})


def test_loss_scaler_choice():
    assert scaler_for(False, 8.0, False, None, explicit=True) is None  # fp16 only, as in SMP
    static = scaler_for(True, 8.0, False, None, explicit=True)
    assert isinstance(static, StaticLossScaler) and static.scale == 8.0
    static.update(overflow=True)
    assert static.scale == 8.0
    assert scaler_for(True, None, False, None, explicit=False).scale == 2.0**16  # smsdp's default


def test_step_splits_nested_inputs_along_the_named_axis():
    batch = {"ids": torch.arange(8).view(4, 2), "extra": [torch.arange(4), "tag"]}
    first = _split(batch, 0, 2, 0, "batch")
    assert first["ids"].tolist() == [[0, 1], [2, 3]] and first["extra"][0].tolist() == [0, 1]
    assert first["extra"][1] == "tag"
    assert _split(torch.arange(8).view(2, 4), 1, 2, 1, "x").tolist() == [[2, 3], [6, 7]]
    with pytest.raises(ValueError, match="non_split_inputs"):
        _split(torch.arange(3), 0, 2, 0, "odd")


@pytest.mark.parametrize("name", ["amp", "nn", "optimizers", "state"])
def test_submodules_import_by_their_smp_v1_names(name):
    """``from smdistributed.modelparallel.torch.nn import X`` becomes ``from smsdp.nn import X``."""
    module = importlib.import_module(f"smsdp.{name}")
    assert module is importlib.import_module(f"smsdp.smp.{name}")
    assert getattr(smp, name) is module


def test_from_smsdp_nn_import_a_layer():
    from smsdp.nn import DistributedTransformerLMHead, FusedLayerNorm

    assert DistributedTransformerLMHead is smp.nn.DistributedTransformerLMHead
    assert issubclass(FusedLayerNorm, torch.nn.LayerNorm)
