"""Where the TPU kernels were measured slower than XLA `chunk` on a chip: dispatch passes them
over there (a call that names `pallas_tpu` still gets it).

Each row is one kind of call on one TPU generation, with the figures that decided it: medians in
ms, forward / forward+backward, from `benchmarks/tpu_paths.py` on that chip (its results:
`benchmarks/results/tpu.md`). A kind of call is passed over when `chunk` was faster
forward+backward (what training runs) at every measured shape of that kind; a kind with no row
keeps the kernel (measured faster, or not measured: the kernel's priority decides).

| generation | operation | calls | `pallas_tpu` | `chunk` |
|---|---|---|---|---|
| v5e | `recurrent` | a per-key-channel decay (`gk`, or `g` per channel) | 34.20 / 76.42 (bf16), 38.25 / 85.52 (f32) | 6.98 / 24.58, 11.39 / 36.72 |
| v5e | `delta_rule` | every gate | GDN 6.83 / 19.77, KDA 36.99 / 123.08 (bf16) | 6.01 / 13.78, 6.91 / 20.07 |

Shapes: `recurrent` B4 T4096 H16 K=V=64 (and B2 T8192 H16 K=V=128 for `gk`: 34.25 / 76.58 against
7.29 / 29.52); `delta_rule` B1 T4096, 32 value and 16 query/key heads, K=V=128. Kept: `recurrent`
with a per-head decay (`g` bf16 3.02 / 9.71 against 5.05 / 13.87; `g_gamma` 2.91 / 8.01 against
5.03 / 13.08; float32 5.74 / 14.75 against 7.33 / 20.11).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ...problem import Gate
from ...registry import Request


@dataclasses.dataclass(frozen=True)
class Slower:
    """One kind of call on which a measurement found `chunk` faster than the kernel."""

    generation: str
    operation: str
    applies: Callable[[Request], bool]
    figures: str

    def reason(self, operation: str, request: Request) -> str | None:
        chip = request.device
        if operation != self.operation or chip.backend != "tpu" or chip.generation != self.generation:
            return None
        if not self.applies(request):
            return None
        return (f"measured slower than chunk on TPU {self.generation} ({self.figures}; "
                "benchmarks/results/tpu.md)")


SLOWER_THAN_CHUNK = (
    Slower("v5e", "recurrent", lambda request: Gate.KEY in request.gates,
           "per-key-channel decay, fwd / fwd+bwd 34.20 / 76.42 ms against 6.98 / 24.58 at B4 T4096 H16 K=V=64 bf16"),
    Slower("v5e", "delta_rule", lambda request: True,
           "GDN 6.83 / 19.77 ms against 6.01 / 13.78, KDA 36.99 / 123.08 against 6.91 / 20.07, fwd / fwd+bwd at "
           "B1 T4096 Hv32 Hqk16 K=V=128 bf16"),
)


def passed_over(operation: str) -> Callable[[Request], str | None]:
    """The registry's test for `operation`'s kernel: why dispatch passes it over, or None."""

    def reason(request: Request) -> str | None:
        return next((r for r in (row.reason(operation, request) for row in SLOWER_THAN_CHUNK) if r), None)

    return reason
