"""The `recurrax` command line and its helpers: tools built on the library, never imported by it.

| module     | what it is                                                              |
|------------|-------------------------------------------------------------------------|
| `cli`      | the `recurrax` entry point: `check`, `bench`, `demo`, `generate`, `serve` |
| `cases`    | the one maker of test and benchmark inputs; comparison with the oracle  |
| `check`    | `recurrax check`: every implementation against the float64 reference    |
| `bench/`   | `recurrax bench`: speed and memory                                      |
| `demo`     | `recurrax demo`: train a small model on associative recall (MQAR)       |
| `mqar`     | the MQAR task the demo trains on                                        |
| `generate` | `recurrax generate`: options over `recurrax.generation`'s text streams  |
| `serve`    | `recurrax serve`: options over `recurrax.generation.serve`              |
| `options`  | argument types of the options: bad values exit 2 naming the option      |
"""
