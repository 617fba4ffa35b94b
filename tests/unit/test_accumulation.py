"""Which backward ends the step: declared (backward_passes_per_step), or guessed from the last step."""

from __future__ import annotations

import pytest

from smsdp.core.accumulation import AccumulationBoundary


def _steps(boundary: AccumulationBoundary, counts: list[int]) -> list[list[bool]]:
    """Per step, for each backward: was it taken to end the step (as DistributedModel asks)."""
    seen = []
    for count in counts:
        taken, syncing = [], False
        for _ in range(count):
            syncing = boundary.begin(syncing)
            taken.append(syncing)
            boundary.end()
        boundary.step()
        seen.append(taken)
    return seen


def test_undeclared_the_first_step_guesses_nothing_then_the_last_steps_length_is_the_guess():
    seen = _steps(AccumulationBoundary(None), [1, 1, 2, 2, 3, 1, 2])
    assert seen == [
        [False],  # nothing learned yet: the sync waits for step()
        [True],
        [True, False],  # guessed 1, wrong: the second backward is not taken to end it too
        [False, True],
        [False, True, False],  # guessed 2, wrong
        [False],  # guessed 3: the step ended sooner, nothing started early
        [True, False],  # guessed 1, wrong
    ]


def test_a_wrong_guess_is_remembered_until_the_step_and_forgotten_after():
    boundary = AccumulationBoundary(None)
    _steps(boundary, [1])
    assert boundary.begin(syncing=False) is True
    boundary.end()
    assert boundary.begin(syncing=True) is False and boundary.mispredicted
    boundary.end()
    boundary.step()
    assert not boundary.mispredicted and boundary.period == 2


def test_discarding_the_gradients_forgets_a_wrong_guess():
    boundary = AccumulationBoundary(None)
    _steps(boundary, [1])
    boundary.begin(syncing=False)
    boundary.end()
    boundary.begin(syncing=True)
    boundary.discard()
    assert not boundary.mispredicted


def test_declared_every_kth_backward_ends_the_step():
    assert _steps(AccumulationBoundary(2), [2, 2]) == [[False, True], [False, True]]


def test_declared_a_backward_beyond_the_declared_count_is_refused():
    boundary = AccumulationBoundary(1)
    assert boundary.begin(syncing=False) is True
    boundary.end()
    with pytest.raises(RuntimeError, match="backward_passes_per_step=1"):
        boundary.begin(syncing=True)
