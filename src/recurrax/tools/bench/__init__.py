"""`recurrax bench`, split by job.

| module     | job                                                                   |
|------------|-----------------------------------------------------------------------|
| `machine`  | machine facts and the measured float32 matmul peak                    |
| `measure`  | programs, compile, memory analysis, timing, the grid                  |
| `report`   | markdown tables, the plot, the output files                           |
| `command`  | the command line: options, the run, the summary                       |
"""

from .command import main

__all__ = ["main"]
