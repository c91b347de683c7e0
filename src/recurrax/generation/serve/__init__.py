"""The server of `recurrax serve`: OpenAI-compatible HTTP over a `DecodePool`, split by job
(its command line is `recurrax.tools.serve`).

| module     | job                                                                     |
|------------|-------------------------------------------------------------------------|
| `requests` | OpenAI request bodies checked (within `Limits`) and turned into jobs    |
| `templates`| the chat template in a worker process, bounded in time and memory       |
| `engine`   | the thread that owns the model: a bounded queue, continuous batching    |
| `app`      | the routes on Starlette, OpenAI's JSON and server-sent events           |
| `protocol` | uvicorn's h11 protocol with a header timeout                            |
| `server`   | `serve`: loading, warm-up, uvicorn, shutdown; `StartError`              |

Needs the `serve` extra (`pip install 'recurrax[serve]'`: starlette, uvicorn).
"""

from .server import StartError, serve

__all__ = ["StartError", "serve"]
