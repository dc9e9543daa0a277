"""The detector's three code paths on the same logged columns: ``observe()`` row by row (the
live hook), ``observe()`` with the calm fast path turned off (the general step only), and
``observe_columns()`` (offline replay). They must give the same alerts and the same state."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from earlywarn.detect import StreamingDetector


def replay_three_ways(cols, names: Sequence[str], cuts: Sequence[int]) -> tuple[StreamingDetector, list]:
    """Feed ``cols`` to the three paths in the chunks ``cuts`` gives, checking after each chunk
    that their states agree bit for bit; returns the row-by-row detector and its alerts
    ``[(row, message)]`` (asserted equal on the three paths)."""
    same = lambda s: s._replace(stats=None, dev=None)  # noqa: E731 - the arrays are compared apart
    rows, full, by_cols = (StreamingDetector(layer_names=list(names)) for _ in range(3))
    full.detector._force_full = True
    got: dict[str, list] = {"rows": [], "full": [], "cols": []}
    for a, b in zip(cuts[:-1], cuts[1:]):
        for i in range(a, b):
            o = cols.observation(i)
            got["rows"] += [(i, e.message) for e in rows.observe(o)]
            got["full"] += [(i, e.message) for e in full.observe(o)]
        got["cols"] += [(i, e.message) for i, e in by_cols.observe_columns(cols, a, b)]
        s1, s2, s3 = rows.state, full.state, by_cols.state
        assert s1.channels == s2.channels == s3.channels
        np.testing.assert_array_equal(s1.stats, s3.stats)
        np.testing.assert_array_equal(s1.stats, s2.stats)
        # the general step leaves a NaN deviation where the calm path never computed one
        np.testing.assert_array_equal(np.nan_to_num(s1.dev), np.nan_to_num(s2.dev))
        np.testing.assert_array_equal(s1.dev, s3.dev)
        assert same(s1) == same(s3) and same(s1) == same(s2)
    assert got["rows"] == got["cols"] == got["full"]
    return rows, got["rows"]
