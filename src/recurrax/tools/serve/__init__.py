"""`recurrax serve`: an OpenAI-compatible HTTP server, split by job.

| module     | job                                                                     |
|------------|-------------------------------------------------------------------------|
| `requests` | OpenAI request bodies checked and turned into jobs; error JSON          |
| `engine`   | the thread that owns the model: a bounded queue, continuous batching    |
| `app`      | the routes on Starlette, OpenAI's JSON and server-sent events           |
| `command`  | the command line: options, loading, warm-up, uvicorn, shutdown          |

Needs the `serve` extra (`pip install 'recurrax[serve]'`: starlette, uvicorn).
"""

from .command import main

__all__ = ["main"]
