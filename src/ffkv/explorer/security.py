"""Who may talk to the explorer: a Host allow-list, cross-site request checks, an optional access token,
and security headers on every response.

The explorer is a local tool, but a browser is a confused deputy: any page it visits can send requests
to 127.0.0.1. Three things keep those out.

* **Host allow-list** (DNS rebinding): a page on ``evil.example`` whose name is made to resolve to
  127.0.0.1 sends ``Host: evil.example``; only loopback names and the names the server was started with
  are answered.
* **Cross-site requests** (CSRF): a state-changing request (any method but GET and HEAD) from a browser
  carries ``Origin`` and ``Sec-Fetch-Site``; it is refused unless they say it came from the explorer's
  own origin (OWASP's "verify origin with standard headers"). Clients that are not browsers (curl,
  scripts) send neither and are not a CSRF vector.
* **Access token** (non-loopback binds): every request must carry the token, as ``?token=`` once (it
  is then kept in an HttpOnly, SameSite=Strict cookie), the cookie, or ``Authorization: Bearer``.

Every response carries a Content-Security-Policy that allows no script at all and no framing, and
``nosniff``; the pages need neither scripts nor anything from another origin.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from collections.abc import Iterable
from http.cookies import SimpleCookie
from urllib.parse import parse_qsl, urlencode, urlsplit

__all__ = ["Guard", "HEADERS", "LOOPBACK_NAMES", "MIN_TOKEN", "TOKEN_COOKIE", "host_name", "is_loopback", "new_token"]

#: Host names a loopback server answers to.
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
#: The shortest access token accepted beyond loopback (`ffkv serve --token`); the random one has 43 characters.
MIN_TOKEN = 16
#: The cookie that keeps the access token after the first ``?token=`` visit.
TOKEN_COOKIE = "ffkv_token"
#: Methods that never change anything on the server.
SAFE_METHODS = frozenset({"GET", "HEAD"})
#: Security headers of every response. No scripts anywhere; inline styles (the pages' own CSS and the
#: per-token shading) and images from the run are all a page loads.
HEADERS = (
    (b"content-security-policy", b"default-src 'none'; img-src 'self' data:; style-src 'unsafe-inline'; "
                                 b"form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    # Not no-referrer: under it a browser sends "Origin: null" with the page's own form posts.
    (b"referrer-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
)


def new_token() -> str:
    """A fresh random access token (32 bytes, URL-safe)."""
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    """Whether binding to `host` reaches only this machine (127.0.0.0/8, ::1, localhost)."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The name part of a Host header or an Origin's netloc, lower case, without port or brackets; empty
    (answered by no one) for a value that is not a host with an optional numeric port (RFC 9110's
    ``uri-host [":" port]``): user-info (``127.0.0.1:8000@evil.example``), a path, a space, a bad port."""
    value = value.strip().lower()
    if not value or any(c in value for c in "@/\\?#% \t") or any(ord(c) < 33 or ord(c) > 126 for c in value):
        return ""
    if value.startswith("["):  # [::1]:8000
        name, bracket, port = value[1:].partition("]")
        return name if bracket and (not port or (port[0] == ":" and _port(port[1:]))) else ""
    if value.count(":") > 1:  # a bare IPv6 address
        return value
    name, _, port = value.partition(":")
    return name if _port(port) else ""


def _port(text: str) -> bool:
    return text == "" or text.isdigit()


class Guard:
    """ASGI middleware that applies the module's checks and headers to every HTTP request.

    Args:
        app: the ASGI app to guard.
        hosts: host names answered besides the loopback names; ``"*"`` answers any (only sensible with a
            token, for a server bound to every interface).
        token: the access token every request must carry, or None for none.
    """

    def __init__(self, app, hosts: Iterable[str] = (), token: str | None = None) -> None:
        self.app = app
        names = {host_name(h) for h in hosts if h}
        self.any_host = "*" in names
        self.hosts = frozenset(LOOPBACK_NAMES | names - {"*"})
        self.token = token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = self.refusal(scope, headers)
        if refusal is not None:
            await self.respond(send, *refusal)
            return
        if self.token is not None and self.token_in_query(scope):
            # The token came in the URL: keep it in a cookie, and show the URL without it.
            await self.respond(send, 303, "", extra=[
                (b"location", self.without_token(scope).encode("latin-1")),
                (b"set-cookie", f"{TOKEN_COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/".encode())])
            return

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                present = {k.lower() for k, _ in message.get("headers", [])}
                message["headers"] = list(message.get("headers", [])) + [h for h in HEADERS if h[0] not in present]
            await send(message)

        await self.app(scope, receive, send_with_headers)

    # ------------------------------------------------------------------ checks
    def refusal(self, scope, headers: dict[str, str]) -> tuple[int, str] | None:
        """(status, message) for a request that is not let in, or None."""
        host = host_name(headers.get("host", ""))
        if not host:
            return 400, "the request's Host header is not a host name with an optional port"
        if not self.any_host and host not in self.hosts:
            return 421, (f"this explorer does not answer to the host name {host[:100]!r}; start it with "
                         f"`ffkv serve RUN --allow-host {host[:100]}` if that name is yours")
        if self.token is not None and not self.authorised(scope, headers):
            return 401, ("this explorer needs its access token: open the URL with ?token=... that `ffkv serve` "
                         "printed, or send 'Authorization: Bearer TOKEN'")
        if scope["method"] not in SAFE_METHODS and not self.same_origin(headers):
            return 403, ("cross-site request refused: changes are accepted only from the explorer's own pages "
                         "(the request's Origin or Sec-Fetch-Site names another site)")
        return None

    @staticmethod
    def same_origin(headers: dict[str, str]) -> bool:
        """A browser's request from the explorer's own pages, or a request from a client that is not a browser."""
        site = headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            return False
        origin = headers.get("origin")
        if origin is None:
            return True
        parts = urlsplit(origin)
        return bool(parts.netloc) and parts.netloc.lower() == headers.get("host", "").strip().lower()

    def authorised(self, scope, headers: dict[str, str]) -> bool:
        offered = []
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except Exception:  # noqa: BLE001 - a malformed cookie header is just no token
            pass
        if TOKEN_COOKIE in cookie:
            offered.append(cookie[TOKEN_COOKIE].value)
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            offered.append(auth[7:].strip())
        offered += [v for k, v in parse_qsl(scope.get("query_string", b"").decode("latin-1")) if k == "token"]
        return any(hmac.compare_digest(o.encode(), self.token.encode()) for o in offered)

    @staticmethod
    def token_in_query(scope) -> bool:
        return scope["method"] in SAFE_METHODS and any(
            k == "token" for k, _ in parse_qsl(scope.get("query_string", b"").decode("latin-1")))

    @staticmethod
    def without_token(scope) -> str:
        rest = [(k, v) for k, v in parse_qsl(scope.get("query_string", b"").decode("latin-1"),
                                             keep_blank_values=True) if k != "token"]
        path = scope.get("root_path", "") + scope["path"]
        return path + ("?" + urlencode(rest) if rest else "")

    @staticmethod
    async def respond(send, status: int, message: str, extra: list | None = None) -> None:
        body = message.encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
            *HEADERS, *(extra or [])]})
        await send({"type": "http.response.body", "body": body})
