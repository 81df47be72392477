"""Human or machine open: analysts exclude machine opens from open rates.

The rule, stated for users in docs/webhooks.md ("Machine opens"), strongest signal first:

1. The provider's own flag says machine (SendGrid ``sg_machine_open``, Mailgun
   ``client-info.bot``, the sandbox's ``machine``): a machine open.
2. Apple Mail Privacy Protection - a bare ``Mozilla/5.0`` agent from Apple's network
   (17.0.0.0/8) - fetches every pixel whether or not the person reads the mail: machine.
3. Gmail's image proxy (``GoogleImageProxy``, via ggpht.com) fetches the pixel when the person
   opens the mail, so behind it is a reader: a human open, however fast.
4. A known prefetcher or scanner agent (Yahoo's mail proxy, security gateways, scripts, bots):
   machine, whenever it opens.
5. An empty agent within ``PREFETCH_WINDOW_S`` of delivery: machine. Anything else is human.
"""

import ipaddress

APPLE_PROXY_NETWORK = ipaddress.ip_network("17.0.0.0/8")
#: In the agent of every fetch through Gmail's image proxy (lower-cased).
GMAIL_PROXY_AGENT = "googleimageproxy"
PREFETCHER_AGENTS = (
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
    """Whether an open was a machine's (see the module docstring for the rule)."""
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
    if GMAIL_PROXY_AGENT in agent:
        # Gmail proxies images when the mail is opened, not on arrival: the person read it.
        return False
    fast = seconds_after_delivery is not None and seconds_after_delivery < PREFETCH_WINDOW_S
    known = any(marker in agent for marker in PREFETCHER_AGENTS)
    # A known prefetcher is a machine whenever it opens; an empty agent only when it is fast.
    return known or (fast and agent == "")
