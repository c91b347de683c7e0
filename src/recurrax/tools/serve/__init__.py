"""`recurrax serve`: an OpenAI-compatible HTTP server, split by job.

| module     | job                                                                     |
|------------|-------------------------------------------------------------------------|
| `requests` | OpenAI request bodies checked (within `Limits`) and turned into jobs    |
| `templates`| the chat template in a worker process, bounded in time and memory       |
| `engine`   | the thread that owns the model: a bounded queue, continuous batching    |
| `app`      | the routes on Starlette, OpenAI's JSON and server-sent events           |
| `protocol` | uvicorn's h11 protocol with a header timeout                            |
| `command`  | the command line: options and limits, loading, warm-up, uvicorn, shutdown |

Needs the `serve` extra (`pip install 'recurrax[serve]'`: starlette, uvicorn).
"""

from .command import main

__all__ = ["main"]
