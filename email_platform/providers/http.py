"""What every HTTP provider adapter shares: keep-alive clients for the run, a timeout on every
call, the run-wide rate limit, and one mapping from response to accepted / transient /
permanent. An adapter only says how to build its request and how to read its answers.

Two ways to send: ``send`` / ``send_many`` block a thread per call (httpx), and ``send_async``
/ ``send_many_async`` run on an event loop (``async_http``), where hundreds of calls in flight
cost little. The dispatcher uses the second where ``async_ready`` says it may.
"""

import asyncio
import json
import threading
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from email_platform.common.classify import classify_exception, classify_response
from email_platform.common.errors import (
    BatchNotSentError,
    DeliveryError,
    PermanentError,
    TransientError,
)
from email_platform.providers.async_http import OriginPool, checked, encode
from email_platform.providers.base import Accepted, OutgoingEmail, RateLimiter, header_problem


@dataclass
class ProviderRequest:
    """One provider call, as the provider documents it."""

    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    json: Any = None
    data: Mapping[str, Any] | list[tuple[str, str]] | None = None
    content: bytes | None = None
    #: Multipart files, ``[(field, (filename, bytes, content type))]`` (Mailgun's attachments).
    files: list[tuple[str, tuple[str, bytes, str]]] | None = None


class HttpProvider:
    """Base of the HTTP adapters. Thread-safe: the run's send threads share one instance."""

    name = "http"

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        auth: httpx.Auth | tuple[str, str] | None = None,
        timeout_s: float = 10.0,
        rate_limit_per_s: float = 0.0,
        max_connections: int = 20,
        retry_after_cap_s: float = 300.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_connections = max(1, max_connections)
        # Each concurrent send borrows a client of its own with one keep-alive connection, at
        # most ``max_connections`` at once. With one shared pool, every request of every send
        # thread took that pool's lock twice and scanned all of its connections; lending whole
        # clients measured 15-25% less client CPU per request with 32 send threads. One TLS
        # context serves them all: building one loads the CA bundle.
        self._options: dict[str, Any] = {
            "base_url": self.base_url,
            "headers": dict(headers or {}),
            "auth": auth,
            "timeout": timeout_s,
            "limits": httpx.Limits(max_connections=1, max_keepalive_connections=1),
            "transport": transport,
        }
        if transport is None:
            self._options["verify"] = httpx.create_ssl_context()
        self.client = httpx.Client(**self._options)
        self._clients = [self.client]
        self._idle = [self.client]
        self._closed = False
        self._urls: dict[str, httpx.URL] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self.limiter = RateLimiter(rate_limit_per_s)
        self.retry_after_cap_s = retry_after_cap_s
        #: Whether ``send_async`` may be used: not with a transport given (a test's mock, which
        #: only the sync client can call), nor through a proxy from the environment (which the
        #: sync client honours and the event-loop client does not speak), nor by a subclass
        #: that changed a blocking method and not its event-loop twin.
        self.async_ready = (
            transport is None and not _proxied(self.base_url) and _async_twins_match(type(self))
        )
        self._templates: dict[tuple[str, str, tuple[str, ...], bool], _Template] = {}
        self._pools: dict[tuple[asyncio.AbstractEventLoop, str, str, int | None], OriginPool] = {}

    # ---- what an adapter provides -----------------------------------------------------------

    def build_request(self, email: OutgoingEmail) -> ProviderRequest:
        raise NotImplementedError

    def accepted(self, response: httpx.Response) -> Accepted:
        """Read the provider's message id from a 2xx answer."""
        raise NotImplementedError

    #: Most messages one ``send_many`` call takes; 1: the adapter has no batch call.
    batch_max = 1

    def build_batch_request(self, emails: Sequence[OutgoingEmail]) -> ProviderRequest:
        """One call for ``emails``, when ``batch_max`` > 1."""
        raise NotImplementedError

    def batch_entries(self, response: httpx.Response, emails: Sequence[OutgoingEmail]) -> list:
        """Each email's entry in a 2xx answer to a batch call, in order, as ``batch_entry``
        reads it; raises when the answer cannot be lined up with the emails."""
        raise NotImplementedError

    def batch_entry(self, entry: Any, response: httpx.Response) -> Accepted | DeliveryError:
        """One email's outcome from its entry; raises (any error) when it cannot be read."""
        raise NotImplementedError

    def error_of(self, response: httpx.Response) -> tuple[str | None, str]:
        """The provider's error code and message from a non-2xx answer."""
        try:
            body = response.json()
        except ValueError:
            return None, response.text[:300]
        if isinstance(body, dict):
            code = body.get("code") or body.get("error_code") or body.get("name")
            message = body.get("message") or body.get("error") or str(body)[:300]
            return (str(code) if code is not None else None), str(message)
        return None, str(body)[:300]

    def classify(self, response: httpx.Response) -> DeliveryError:
        """Map a non-2xx answer; adapters override for provider-specific codes."""
        code, message = self.error_of(response)
        return classify_response(
            response.status_code,
            response.headers,
            code=code,
            message=message,
            retry_after_cap_s=self.retry_after_cap_s,
        )

    # ---- the shared call --------------------------------------------------------------------

    def send(self, email: OutgoingEmail) -> Accepted:
        request = self._request_for(email)
        self.limiter.acquire()
        return self._answer(self._call(request))

    async def send_async(self, email: OutgoingEmail) -> Accepted:
        """``send`` on the running event loop: the same request, checks and answers."""
        request = self._request_for(email)
        await _wait(await self.limiter.reserve_async())
        return self._answer(await self._call_async(request))

    def send_many(self, emails: Sequence[OutgoingEmail]) -> list[Accepted | DeliveryError]:
        """Send ``emails`` in one call (see ``base.BatchingProvider``)."""
        problems = self._batch_problems(emails)
        if any(problems):
            # Refused ones get their own answer; the rest still go out in one call.
            sendable = [
                email for email, problem in zip(emails, problems, strict=True) if not problem
            ]
            sent = iter(self.send_many(sendable) if sendable else [])
            return [problem or next(sent) for problem in problems]
        request = self._batch_request(emails)
        self.limiter.acquire(len(emails))
        try:
            response = self._call(request)
        except DeliveryError as error:
            return [error] * len(emails)
        return self._batch_answer(response, emails)

    async def send_many_async(
        self, emails: Sequence[OutgoingEmail]
    ) -> list[Accepted | DeliveryError]:
        """``send_many`` on the running event loop."""
        problems = self._batch_problems(emails)
        if any(problems):
            sendable = [
                email for email, problem in zip(emails, problems, strict=True) if not problem
            ]
            sent = iter(await self.send_many_async(sendable) if sendable else [])
            return [problem or next(sent) for problem in problems]
        request = self._batch_request(emails)
        await _wait(await self.limiter.reserve_async(len(emails)))
        try:
            response = await self._call_async(request)
        except DeliveryError as error:
            return [error] * len(emails)
        return self._batch_answer(response, emails)

    def _request_for(self, email: OutgoingEmail) -> ProviderRequest:
        problem = header_problem(email)
        if problem is not None:
            raise problem
        return self.build_request(email)

    def _answer(self, response: httpx.Response) -> Accepted:
        if 200 <= response.status_code < 300:
            try:
                return self.accepted(response)
            except (ValueError, KeyError, TypeError) as exc:
                raise self._unreadable(response) from exc
        raise self.classify(response)

    def _batch_problems(self, emails: Sequence[OutgoingEmail]) -> list[DeliveryError | None]:
        if len(emails) > self.batch_max:
            raise ValueError(f"{len(emails)} emails; {self.name} takes {self.batch_max} a call")
        return [header_problem(email) for email in emails]

    def _batch_request(self, emails: Sequence[OutgoingEmail]) -> ProviderRequest:
        try:
            return self.build_batch_request(emails)
        except Exception as exc:  # nothing sent: maybe one message's fault, split (invariant 9)
            raise BatchNotSentError(classify_exception(exc)) from exc

    def _batch_answer(
        self, response: httpx.Response, emails: Sequence[OutgoingEmail]
    ) -> list[Accepted | DeliveryError]:
        if not 200 <= response.status_code < 300:
            error = self.classify(response)
            refused_whole = response.status_code in (400, 413, 422) and len(emails) > 1
            if refused_whole and isinstance(error, PermanentError):
                # Maybe one message's fault: raised, the dispatcher sends them one a call, so
                # only that one fails (invariant 9).
                raise BatchNotSentError(error)
            return [error] * len(emails)
        # A 2xx answer: any message may be accepted, so whatever its body holds, each email
        # gets a result here and none is sent again in this attempt (invariant 3).
        try:
            entries = list(self.batch_entries(response, emails))
        except Exception:  # the answer cannot be lined up with the emails: none is readable
            return [self._unreadable(response)] * len(emails)
        if len(entries) != len(emails):
            return [self._unreadable(response)] * len(emails)
        return [self._batch_entry(entry, response) for entry in entries]

    def _batch_entry(self, entry: Any, response: httpx.Response) -> Accepted | DeliveryError:
        # One entry unreadable is that email's answer alone, as a single send's unreadable 2xx
        # is: retried under its own key; the entries read beside it keep their outcomes.
        try:
            return self.batch_entry(entry, response)
        except DeliveryError as error:
            return error
        except Exception:
            return self._unreadable(response)

    def _call(self, request: ProviderRequest) -> httpx.Response:
        client = self._checkout()
        try:
            return client.request(
                request.method,
                self._url(request.path),
                headers=request.headers,
                json=request.json,
                data=request.data,
                content=request.content,
                files=request.files,
            )
        except httpx.HTTPError as exc:
            raise classify_exception(exc) from exc
        finally:
            self._checkin(client)

    async def _call_async(self, request: ProviderRequest) -> httpx.Response:
        try:
            wire = self._wire(request)
            if wire is None:
                built = self.client.build_request(
                    request.method,
                    self._url(request.path),
                    headers=request.headers,
                    json=request.json,
                    data=request.data,
                    content=request.content,
                    files=request.files,
                )
                built.read()  # a multipart body (Mailgun's files) is a stream until read
                auth = self.client.auth
                if auth is not None:
                    # Basic auth and SigV4 sign in one step, without seeing an answer.
                    built = next(auth.sync_auth_flow(built))
                wire = built.url, encode(built)
            url, payload = wire
            return await self._pool_for(url).send(payload)
        except httpx.HTTPError as exc:
            raise classify_exception(exc) from exc

    def _wire(self, request: ProviderRequest) -> tuple[httpx.URL, bytes] | None:
        """``request``'s URL and bytes, without building an ``httpx.Request`` (which cost more
        than the rest of a call): the headers come from a template httpx built once for this
        method, path and header names, so their names, order and values are what httpx sends;
        a JSON body is encoded as httpx encodes it. None where httpx must build the request:
        an auth flow, form data, cookies, or a header value that is not ASCII."""
        if request.data is not None or self.client.auth is not None or self.client.cookies:
            return None
        if request.content is not None and not request.content:
            return None  # an empty body's Content-Length is placed by rules of its own
        key = (request.method, request.path, tuple(request.headers), request.json is not None)
        template = self._templates.get(key)
        if template is None:
            template = _Template.of(self.client, request, self._url(request.path))
            if len(self._templates) < 64:
                self._templates[key] = template
        if request.json is not None:
            body = json.dumps(
                request.json, ensure_ascii=False, separators=(",", ":"), allow_nan=False
            ).encode()
        else:
            body = request.content or b""
        try:
            return template.url, template.fill(request.headers, body)
        except UnicodeEncodeError:
            return None

    def _pool_for(self, url: httpx.URL) -> OriginPool:
        """This origin's connections on the running loop: a pool per loop and origin, since a
        connection belongs to the loop that opened it (two senders may share one provider)."""
        loop = asyncio.get_running_loop()
        key = (loop, url.scheme, url.host, url.port)
        pool = self._pools.get(key)
        if pool is None:
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"the {self.name} provider is closed")
                # Pools of loops that have ended hold nothing usable.
                for old in [k for k, p in self._pools.items() if p.loop.is_closed()]:
                    del self._pools[old]
                pool = self._pools[key] = OriginPool(
                    url,
                    max_connections=self.max_connections,
                    timeout_s=self.timeout_s,
                    ssl_context=self._options.get("verify"),
                )
        return pool

    def _unreadable(self, response: httpx.Response) -> TransientError:
        # Accepted or not, we cannot tell: retrying under the same key is the safe side.
        return TransientError(
            f"unreadable {response.status_code} answer from {self.name}",
            status_code=response.status_code,
            code="unreadable_response",
        )

    def _url(self, path: str) -> httpx.URL:
        """``path`` joined to the base URL the client's own way, parsed once per path.

        Joining and parsing a relative URL was over half of httpx's per-request build cost;
        an absolute ``httpx.URL`` goes through as it is. Adapters send to a few fixed paths.
        """
        url = self._urls.get(path)
        if url is None:
            url = self.client.build_request("GET", path).url
            if len(self._urls) < 64:
                self._urls[path] = url
        return url

    def _checkout(self) -> httpx.Client:
        """An idle client (the most recently used, its connection is the likeliest alive)."""
        if not self._slots.acquire(timeout=self.timeout_s):
            # What the shared pool raised when no connection freed up in time: transient.
            raise classify_exception(httpx.PoolTimeout("no free connection to the provider"))
        with self._lock:
            if self._idle:
                return self._idle.pop()
            if self._closed:
                self._slots.release()
                raise RuntimeError(f"the {self.name} provider is closed")
            client = httpx.Client(**self._options)
            self._clients.append(client)
            return client

    def _checkin(self, client: httpx.Client) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(client)
        self._slots.release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._idle = list(self._clients), []
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close_threadsafe()
        for client in clients:
            client.close()


class _Template:
    """The request line and headers of one kind of request, as httpx builds them, with the
    places of the values that change from request to request: the request's own headers and
    the body's length."""

    _OWN, _LENGTH = 1, 2

    def __init__(self, url: httpx.URL, start: bytes, parts: list[tuple[int, bytes, str]]) -> None:
        self.url = url
        self.start = start
        #: (0, the whole line, "") | (_OWN, the name, the request header's key) | (_LENGTH, ...)
        self.parts = parts

    @classmethod
    def of(cls, client: httpx.Client, request: ProviderRequest, url: httpx.URL) -> "_Template":
        marks = {name: f"x-template-{i}" for i, name in enumerate(request.headers)}
        probe = client.build_request(
            request.method,
            url,
            headers=marks,
            json={} if request.json is not None else None,
            # Non-empty: an empty body gets its Content-Length elsewhere in the order.
            content=b"-" if request.json is None and request.content else None,
        )
        owner = {mark.encode(): name for name, mark in marks.items()}
        has_body = request.json is not None or bool(request.content)
        parts: list[tuple[int, bytes, str]] = []
        for name, value in probe.headers.raw:
            if value in owner:
                parts.append((cls._OWN, name, owner[value]))
            elif name.lower() == b"content-length" and has_body:
                parts.append((cls._LENGTH, name, ""))
            else:
                parts.append((0, name + b": " + checked(value) + b"\r\n", ""))
        start = probe.method.encode() + b" " + probe.url.raw_path + b" HTTP/1.1\r\n"
        return cls(probe.url, start, parts)

    def fill(self, headers: dict[str, str], body: bytes) -> bytes:
        lines = [self.start]
        for kind, value, key in self.parts:
            if kind == self._OWN:
                lines += [value, b": ", checked(headers[key].encode("ascii")), b"\r\n"]
            elif kind == self._LENGTH:
                lines += [value, b": ", str(len(body)).encode(), b"\r\n"]
            else:
                lines.append(value)
        lines += [b"\r\n", body]
        return b"".join(lines)


async def _wait(delay_s: float) -> None:
    if delay_s > 0:
        await asyncio.sleep(delay_s)


#: Each blocking method and its event-loop twin.
_TWINS = (("send", "send_async"), ("send_many", "send_many_async"), ("_call", "_call_async"))


def _async_twins_match(cls: type) -> bool:
    """Whether ``cls`` overrides no blocking method without overriding its twin too."""
    return all(
        getattr(cls, blocking) is getattr(HttpProvider, blocking)
        or getattr(cls, twin) is not getattr(HttpProvider, twin)
        for blocking, twin in _TWINS
    )


def _proxied(base_url: str) -> bool:
    """Whether the environment routes ``base_url`` through a proxy (as httpx reads it)."""
    proxies = urllib.request.getproxies_environment()
    url = httpx.URL(base_url)
    if not (proxies.get(url.scheme) or proxies.get("all")):
        return False
    return not urllib.request.proxy_bypass_environment(url.host, proxies)
