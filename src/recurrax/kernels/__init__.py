"""Pallas kernels of the chunk algorithm, one folder per backend, sharing one driver.

| module        | backend                                   | registered as                      |
|---------------|-------------------------------------------|------------------------------------|
| `_driver`     | any: reverse, padding, packed layout,     |                                    |
|               | gate gradients, the custom_vjp, launches  |                                    |
| `triton/`     | Pallas → Triton (GPUs while JAX ships it) | `pallas_gpu`, `pallas_interpret`   |
| `mosaic_gpu/` | Pallas → Mosaic GPU (Hopper)              | `mosaic_gpu`                       |
| `tpu/`        | Pallas → Mosaic TPU (v5e, v6e)            | `pallas_tpu`                       |

A backend is a folder of kernels whose launch functions take a `KernelConfig`, one
`PallasBackend` naming them (its `recurrent` and `interpret` are the entry points), and its
`Support`; `recurrax/implementations.py` registers it.
"""

from ._driver import KernelConfig, PallasBackend, kernel_recurrent

__all__ = ["KernelConfig", "PallasBackend", "kernel_recurrent"]
