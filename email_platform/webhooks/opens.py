"""Human or machine open: analysts exclude machine opens from open rates.

Signals, strongest first: the provider's own flag (SendGrid ``sg_machine_open``); Apple Mail
Privacy Protection, which fetches every pixel from Apple's network (17.0.0.0/8) with a bare
``Mozilla/5.0`` agent; and security scanners or link prefetchers that open within seconds of
delivery with a recognizable agent.
"""

import ipaddress

APPLE_PROXY_NETWORK = ipaddress.ip_network("17.0.0.0/8")
PREFETCHER_AGENTS = (
    "googleimageproxy",
    "yahoomailproxy",
    "barracuda",
    "mimecast",
    "proofpoint",
    "symantec",
    "python-requests",
    "curl/",
    "bot",
    "spider",
    "crawler",
    "prefetch",
)
PREFETCH_WINDOW_S = 10.0


def is_machine_open(
    *,
    user_agent: str | None,
    ip: str | None,
    seconds_after_delivery: float | None,
    provider_flag: bool | None = None,
) -> bool:
    if provider_flag:
        return True
    agent = (user_agent or "").strip().lower()
    if ip:
        try:
            from_apple = ipaddress.ip_address(ip) in APPLE_PROXY_NETWORK
        except ValueError:
            from_apple = False
        if from_apple and agent in ("", "mozilla/5.0"):
            return True
    fast = seconds_after_delivery is not None and seconds_after_delivery < PREFETCH_WINDOW_S
    known = any(marker in agent for marker in PREFETCHER_AGENTS)
    # A known prefetcher is a machine whenever it opens; an empty agent only when it is fast.
    return known or (fast and agent == "")
