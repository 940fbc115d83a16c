"""Transitional: the stream engine's primitives live in `serve/streams/wire.py` (removed once every door moved)."""

from .streams.wire import *  # noqa: F403
from .streams.wire import (  # noqa: F401
    BadFrame,
    SegmentQueue,
    Stalled,
    buffered,
    end_tasks,
    json_object,
    next_segment,
    segment_failure,
    send_within,
    within,
)
