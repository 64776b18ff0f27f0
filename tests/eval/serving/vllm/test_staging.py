"""``StagedRows``: per-step row indices copied to the device through pinned buffers on CUDA (no host sync), and by
a plain copy where there is no CUDA (vLLM's CPU build, these tests): the CPU path, which is what runs here; the
pinned one has not run (no GPU in this project's tests)."""

from __future__ import annotations

import pytest
import torch

from eval.serving.vllm.staging import BUFFERS, StagedRows


def test_cpu_uploads_land_in_the_static_buffer_whatever_the_previous_step_left():
    staged = StagedRows(16, "cpu", lanes=2)
    assert not staged.pinned and not any(h.is_pinned() for h in staged._host)  # no CUDA: nothing to pin
    steps = [
        ([3, 4, 5, 9, 9, 9, 9, 9], [1] * 5 + [0] * 3),
        ([0, 1], [1, 0]),
        ([7] * 16, [1] * 16),
        ([2, 11, 12], [0, 1, 1]),
    ]
    for rows, writes in steps:  # shorter after longer: only the first len(rows) columns are read
        out = staged.upload(rows, writes)
        assert out.tolist() == [rows, writes] and out.dtype == torch.int32
        assert out.data_ptr() == staged.rows.data_ptr()  # the address CUDA graphs captured
    assert staged._next == len(steps) % BUFFERS  # the host buffers alternate
    assert staged.upload([], []).shape == (2, 0)
    with pytest.raises(ValueError, match="17 rows exceed the staging buffer's 16"):
        staged.upload(list(range(17)), [0] * 17)
    with pytest.raises(ValueError, match=r"2 lists of one length are needed, got lengths \[3, 2\]"):
        staged.upload([1, 2, 3], [0, 1])
    assert StagedRows(4, "cpu").upload([5, 6])[0].tolist() == [5, 6]  # one lane
