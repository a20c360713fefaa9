"""The Host check of a server bound to a loopback address, as Ollama's allowedHostsMiddleware
does it: against DNS rebinding, where a web page's own name comes to resolve to 127.0.0.1
and the browser then lets the page read this server's answers as its own. Such a request
names the page's host in its Host header, which no local client sends."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from server.http.body_limit import CLOSE
from server.http.errors import APIError, shown

# Names only this machine or its local network answers for.
LOCAL_SUFFIXES = (".localhost", ".local", ".internal")
# --allowed-host's value that turns the check off.
ANY_HOST = "*"


def loopback(address: str) -> bool:
    """Is `address` (the server's --host) a loopback one?"""
    if address.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


class LocalHostMiddleware:
    """403 for a request whose Host is not a name of this machine: localhost or a name
    under .localhost, .local or .internal, the machine's host name, an IP address (a page
    whose origin is an address is not rebinding a name), or one of `allowed`. A request
    with no Host (HTTP/1.0) passes, as in Ollama."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str]) -> None:
        self.app = app
        self._allowed = {"localhost", socket.gethostname().lower(),
                         *(name.lower() for name in allowed)}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not self._local(host):
                await APIError(
                    403, f"the Host {shown(host)} is not a name of this server, which "
                    "listens on a loopback address (DNS rebinding); --allowed-host names "
                    "more", code="host_not_allowed", headers=CLOSE,
                ).response(scope)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _local(self, host: str) -> bool:
        name = _without_port(host).lower().rstrip(".")
        if not name or name in self._allowed or name.endswith(LOCAL_SUFFIXES):
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


def _without_port(host: str) -> str:
    if host.startswith("["):  # an IPv6 address: [::1]:8000
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host
