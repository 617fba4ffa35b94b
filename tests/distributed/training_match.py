"""A sharded run against a single-process run of the same model and data: losses and every final parameter."""

from __future__ import annotations

from collections.abc import Callable

import torch

FP32_RTOL = 1e-5
FP32_ATOL = 1e-6  # parameters that pass near zero have no meaningful relative error


def assert_training_matches(
    sharded: dict, reference: dict, label: str, name: Callable[[str], str] = lambda key: key
) -> None:
    """Losses and parameters within fp32's 1e-5 relative; the state-dict keys the same, in order, once
    ``name`` has mapped both (``torch.compile(block)`` adds ``._orig_mod`` to them)."""
    torch.testing.assert_close(
        torch.tensor(sharded["losses"]),
        torch.tensor(reference["losses"]),
        rtol=FP32_RTOL,
        atol=FP32_ATOL,
        msg=lambda m: f"{label} losses: {m}",
    )
    assert [name(k) for k in sharded["params"]] == [name(k) for k in reference["params"]], "state_dict keys differ"
    for (key, value), expected in zip(sharded["params"].items(), reference["params"].values()):
        torch.testing.assert_close(
            value, expected, rtol=FP32_RTOL, atol=FP32_ATOL, msg=lambda m: f"{label} parameter {key}: {m}"
        )
