"""Host-to-device copies of small per-step index lists without a host sync.

``PromptWindow.widen`` hands vLLM a device buffer of row indices it computes on the host every armed step.  A
``non_blocking`` copy from a freshly made (pageable) CPU tensor is not asynchronous: CUDA first stages pageable
memory into pinned memory (CUDA Runtime API, "API synchronization behavior", asynchronous memcpy: "If pageable
memory must first be staged to pinned memory, the driver may synchronize with the stream and stage the copy into
pinned memory"), which can stall the host on the GPU once per armed step.  ``StagedRows`` copies from pinned
buffers it owns instead.

The copy reads its pinned buffer when the stream gets to it, which may be after the host has moved on to the next
step (vLLM's async scheduling prepares step n + 1 while step n runs), so the host must not refill a buffer whose
copy is still queued: two buffers alternate, and each is refilled only after the event recorded behind its last
copy, two steps back, has completed (in practice long since, so the wait costs nothing).  Without CUDA (vLLM's
CPU build, the tests) the buffer is ordinary memory and the copy is a plain one.
"""

from __future__ import annotations

import torch

BUFFERS = (
    2  # a step being prepared and the step running: vLLM overlaps at most one step with the next's inputs
)


class StagedRows:
    """A static device buffer of ``lanes`` x ``rows`` int32 indices (``PromptWindow``: the rows, and which of them
    write exact K/V), filled from host lists through pinned staging buffers."""

    def __init__(self, rows: int, device: torch.device | str, lanes: int = 1):
        device = torch.device(device)
        self.rows = torch.zeros(lanes, rows, dtype=torch.int32, device=device)
        # pinned memory needs a CUDA driver; on the CPU build the copy is host to host and pinning buys nothing
        self.pinned = device.type == "cuda" and torch.cuda.is_available()
        self._host = [
            torch.zeros(lanes, rows, dtype=torch.int32, pin_memory=self.pinned) for _ in range(BUFFERS)
        ]
        self._copied = [torch.cuda.Event() if self.pinned else None for _ in range(BUFFERS)]
        self._next = 0

    def upload(self, *lanes: list[int]) -> torch.Tensor:
        """One list per lane, all of one length n, into the first n columns of the device buffer (a view of it,
        the address vLLM's CUDA graphs captured), queued on the current stream without waiting for the device."""
        n = len(lanes[0])
        if len(lanes) != len(self.rows) or any(len(lane) != n for lane in lanes):
            raise ValueError(
                f"{len(self.rows)} lists of one length are needed, got lengths {[len(v) for v in lanes]}"
            )
        if n > self.rows.shape[1]:
            raise ValueError(
                f"{n} rows exceed the staging buffer's {self.rows.shape[1]} (max_num_batched_tokens)"
            )
        i, self._next = self._next, (self._next + 1) % BUFFERS
        host, copied = self._host[i], self._copied[i]
        if copied is not None:
            copied.synchronize()  # its copy, queued two steps back, has read it
        host.numpy()[:, :n] = lanes
        out = self.rows[:, :n]
        out.copy_(host[:, :n], non_blocking=self.pinned)
        if copied is not None:
            copied.record()
        return out
