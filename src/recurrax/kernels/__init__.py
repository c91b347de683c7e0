"""Pallas kernels of the chunk algorithm, one folder per backend, sharing one driver.

| module      | backend                                   | registered as                      |
|-------------|-------------------------------------------|------------------------------------|
| `_driver`   | any: reverse, padding, packed layout,     |                                    |
|             | gate gradients, the custom_vjp            |                                    |
| `triton/`   | Pallas → Triton (GPUs while JAX ships it) | `pallas_gpu`, `pallas_interpret`   |

A backend provides a hashable `ChunkKernels` (`forward`, `backward`, `chunk`) and declares
its `Support`; `recurrax/implementations.py` registers it.
"""

from ._driver import ChunkKernels, kernel_recurrent

__all__ = ["ChunkKernels", "kernel_recurrent"]
