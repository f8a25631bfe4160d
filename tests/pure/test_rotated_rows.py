"""Realigning ragged rows (``kv/rows.py``): the slices a CPU takes and the
gather a GPU takes rotate each row by its own shift, as ``np.roll`` does."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_server.kv.rows import rotated_rows


@pytest.mark.parametrize("by_slices", [True, False])
def test_each_row_is_rotated_right_by_its_own_shift(by_slices):
    buffer = mx.arange(4 * 2 * 10 * 3, dtype=mx.float32).reshape(4, 2, 10, 3)
    shifts = [0, 3, 1, 9]
    out = np.array(rotated_rows(buffer, shifts, by_slices))
    for b, s in enumerate(shifts):
        np.testing.assert_array_equal(out[b], np.roll(np.array(buffer[b]), s, axis=1))
