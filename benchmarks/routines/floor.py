"""The streaming floor the routines compare against: the best plain 2-read-1-write kernel measured on
an H200 (benchmarks/native/stream_ceiling), its launch latency plus its bandwidth.  A time of 1.00x
the floor is as fast as a plain copy of the same bytes can be."""

FLOOR_US, FLOOR_TBPS = 2.04, 4.37


def floor_us(nbytes):
    """The floor's time to move `nbytes`, us."""
    return FLOOR_US + nbytes / (FLOOR_TBPS * 1e6)
