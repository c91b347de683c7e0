"""uvicorn's h11 HTTP protocol with a header timeout.

uvicorn closes a keep-alive connection idle between requests (`timeout_keep_alive`), but
waits forever for the headers of a request: clients that open connections and never finish
their headers hold a file descriptor each until the process has none left. Here a connection
must complete each request's headers within `header_timeout_s`, counted from its opening
(the first request) or from the first byte of the request (the next ones); else it is
closed. The body has its own limit in the application (`--body-timeout`).
"""

from __future__ import annotations


def header_timeout_protocol(header_timeout_s: float):
    """uvicorn's `H11Protocol` closing connections whose headers take over `header_timeout_s`."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # headers begun, not complete
                self._arm_header_timer()
            else:
                self._disarm_header_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is None and not self.transport.is_closing():
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
