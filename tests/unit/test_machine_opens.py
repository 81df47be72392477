"""The machine-open rule (``webhooks.opens.is_machine_open``) on its own, case by case.

Before: every Gmail open was a machine's (its proxy agent was listed with the prefetchers), so
Gmail readers never counted in an open rate. Now Gmail's proxy is a person unless the provider
flags the open; Apple Mail Privacy Protection and prefetchers stay machines.
"""

import pytest

from email_platform.webhooks.opens import PREFETCH_WINDOW_S, is_machine_open

GMAIL = "Mozilla/5.0 (Windows NT 5.1; rv:11.0) Gecko Firefox/11.0 (via ggpht.com GoogleImageProxy)"
APPLE_IP = "17.58.63.11"
YAHOO = "YahooMailProxy; https://help.yahoo.com/kb/yahoo-mail-proxy-SLN28749.html"
SAFARI = "Mozilla/5.0 (Macintosh; Intel Mac OS X 10_15_7) AppleWebKit/605.1.15 Safari/605.1.15"


@pytest.mark.parametrize(
    ("why", "agent", "ip", "after_s", "flag", "machine"),
    [
        ("Gmail's proxy fetches when the person opens", GMAIL, "66.102.6.229", 3600.0, None, False),
        ("a quick Gmail reader is still a reader", GMAIL, "66.249.84.1", 2.0, None, False),
        ("Gmail with no timing known", GMAIL, None, None, None, False),
        ("the provider says machine, Gmail or not", GMAIL, "66.102.6.229", None, True, True),
        ("the provider's 'no' leaves the agent to judge", GMAIL, None, None, False, False),
        ("Apple MPP: bare agent from Apple's network", "Mozilla/5.0", APPLE_IP, None, None, True),
        ("Apple MPP with no agent at all", None, APPLE_IP, 3600.0, None, True),
        ("a real browser on Apple's network is a person", SAFARI, APPLE_IP, None, None, False),
        ("Yahoo's proxy prefetches", YAHOO, "98.136.1.1", 3600.0, None, True),
        ("a security gateway scans", "Mimecast Link Scanner", None, None, None, True),
        ("a bot agent", "Mozilla/5.0 (compatible; SomeBot/1.0)", None, None, None, True),
        ("a person in a browser", SAFARI, "192.0.2.10", 120.0, None, False),
        ("no agent, at once: a prefetch", "", "192.0.2.10", PREFETCH_WINDOW_S - 1, None, True),
        ("no agent, later: not enough to say machine", "", "192.0.2.10", 600.0, None, False),
        ("an unreadable ip is no Apple proxy", "Mozilla/5.0", "not-an-ip", None, None, False),
    ],
)
def test_is_machine_open(
    why: str,
    agent: str | None,
    ip: str | None,
    after_s: float | None,
    flag: bool | None,
    machine: bool,
) -> None:
    got = is_machine_open(
        user_agent=agent, ip=ip, seconds_after_delivery=after_s, provider_flag=flag
    )
    assert got is machine, why
