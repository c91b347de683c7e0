"""Where the TPU kernels were measured slower than XLA `chunk` on a chip: dispatch passes them
over there (a call that names `pallas_tpu` still gets it).

Each row is one kind of call on one TPU generation, with the figures that decided it: medians in
ms, forward / forward+backward, from `benchmarks/tpu_paths.py` and, with several heads per grid
step and the grouped `gk` diagonal, `benchmarks/tpu_kernel_sweep.py` on that chip (their results:
`benchmarks/results/tpu.md`, `tpu_kernel_sweep.md`). A kind of call is passed over when `chunk` was faster
forward+backward (what training runs) at every measured shape of that kind; a kind with no row
keeps the kernel (measured faster, or not measured: the kernel's priority decides).

| generation | operation | calls | `pallas_tpu` | `chunk` |
|---|---|---|---|---|
| v5e | `recurrent` | a per-key-channel decay (`gk`, or `g` per channel) | lane-dense, 8 heads a step: 10.17 / 47.43 (bf16, calls back to back); head-major before it 10.71 / 36.41 (one head: 10.66 / 36.98; before the grouped diagonal 34.20 / 76.42), 38.25 / 85.52 (f32) | 5.93 / 23.35 (back to back); 7.37 / 24.80, 11.39 / 36.72 |
| v5e | `delta_rule` | every gate | lane-dense, 8 heads a step, GDN 5.63 / 18.47 (bf16, q, k, v held [B, T, H·D] as a model holds them, back to back); head-major before it GDN 6.93 / 19.85, KDA 11.42 / 35.02; lane-dense KDA 10.76 / 36.17 (tpu.md, stop 56) | GDN 5.25 / 14.59 (same), 4.80 / 13.25 (held [B, T, H, D]); 5.82 / 14.25, KDA 7.37 / 29.15 before; KDA 7.27 / 21.56 (stop 56) |

Shapes: `recurrent` B4 T4096 H16 K=V=64 (and B2 T8192 H16 K=V=128 for `gk`: 34.25 / 76.58 against
7.29 / 29.52); `delta_rule` B1 T4096, 32 value and 16 query/key heads, K=V=128. Kept: `recurrent`
with a per-head decay (`g` bf16, calls back to back: with the gate gradient in the backward kernel
and q, k, v held [B, T, H·D], 1.44 / 4.86 at 8 heads a step against `chunk`'s 3.65 / 9.66,
`benchmarks/results/tpu_path_profile.md`; before that, held [B, T, H, D], 1.54 / 7.35 at 16 heads,
1.57 / 7.46 at 8, against 2.19 / 9.17; head-major before it at 8 heads 3.04 / 8.35 against 3.11 / 10.58 at
its TPU tiling; one head a step 2.95 / 9.84; `g_gamma` 2.91 / 8.01 against 5.03 / 13.08 and
float32 5.74 / 14.75 against 7.33 / 20.11, both at one head and `chunk`'s earlier tiling).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..._core.problem import Gate
from ..._core.registry import Request


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
                "benchmarks/results/tpu.md, tpu_kernel_sweep.md)")


SLOWER_THAN_CHUNK = (
    Slower("v5e", "recurrent", lambda request: Gate.KEY in request.gates,
           "per-key-channel decay, fwd / fwd+bwd 10.17 / 47.43 ms at 8 heads a grid step against 5.93 / 23.35 at "
           "B4 T4096 H16 K=V=64 bf16"),
    Slower("v5e", "delta_rule", lambda request: True,
           "GDN 5.63 / 18.47 ms against 5.25 / 14.59 (lane-dense, 8 heads a step), KDA 11.42 / 35.02 against "
           "7.37 / 29.15 (head-major), fwd / fwd+bwd at B1 T4096 Hv32 Hqk16 K=V=128 bf16"),
)


def passed_over(operation: str) -> Callable[[Request], str | None]:
    """The registry's test for `operation`'s kernel: why dispatch passes it over, or None."""

    def reason(request: Request) -> str | None:
        return next((r for r in (row.reason(operation, request) for row in SLOWER_THAN_CHUNK) if r), None)

    return reason
