"""``TrainingState``: where a sharded model is in its cycle of forwards, backwards and steps (one enum,
read and changed by ``smsdp.core.model`` only)."""

from __future__ import annotations

import enum


class TrainingState(enum.Enum):
    """Where the model is in its cycle of forwards, backwards and steps."""

    LEARNING_ORDER = "learning_order"  # no forward with grad has finished: the unit order is unknown
    IDLE = "idle"  # the order is known; no backward is running
    BACKWARD = "backward"  # a backward that does not end the gradient accumulation
    BOUNDARY_BACKWARD = "boundary_backward"  # the backward that ends it: the second hop starts inside
    SYNCING = "syncing"  # after a boundary backward: replica all-reduces in flight until step()


IN_BACKWARD = (TrainingState.BACKWARD, TrainingState.BOUNDARY_BACKWARD)
