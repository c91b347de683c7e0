"""Pallas kernels of the chunk algorithm, one folder per backend, one driver per operation.

| module              | backend                                   | registered as                      |
|---------------------|-------------------------------------------|------------------------------------|
| `_driver`           | any: what both operations' drivers share: |                                    |
|                     | padding, packed layout, `KernelConfig`    |                                    |
| `_recurrent_driver` | any: `recurrent`'s custom_vjp, reverse,   |                                    |
|                     | gate gradients, `PallasBackend`           |                                    |
| `_delta_driver`     | any: the delta rule's custom_vjp          |                                    |
| `triton/`           | Pallas → Triton (GPUs while JAX ships it) | `pallas_gpu`, `pallas_interpret`   |
| `mosaic_gpu/`       | Pallas → Mosaic GPU (Hopper)              | `mosaic_gpu`                       |
| `tpu/`              | Pallas → Mosaic TPU (v5e, v6e), both operations | `pallas_tpu`                 |

A backend is a folder of kernels whose launch functions take a `KernelConfig`, one
`PallasBackend` naming them (its `recurrent` and `interpret` are the entry points), and its
`Support`; `recurrax/implementations.py` registers it.
"""

from ._driver import KernelConfig
from ._recurrent_driver import PallasBackend, kernel_recurrent

__all__ = ["KernelConfig", "PallasBackend", "kernel_recurrent"]
