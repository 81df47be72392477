"""A private Postfix instance on loopback ports, delivering every message to a Maildir.

Debian's Postfix (``scripts/install_test_servers.sh`` installs it) runs with its own
configuration, queue and mail directories under a temporary directory, so it neither touches nor
minds the machine's own Postfix on port 25. One instance serves a whole test session (one per
xdist worker: the directory and the ports are the worker's own) and listens on five ports:

- ``plain``: no TLS, no AUTH, 8BITMIME and SMTPUTF8 offered;
- ``legacy``: the same, with 8BITMIME and SMTPUTF8 hidden (``smtpd_discard_ehlo_keywords``);
- ``submission``: STARTTLS, then AUTH (never offered before TLS: ``smtpd_tls_auth_only``);
- ``smtps``: implicit TLS and AUTH;
- ``cleartext_auth``: AUTH offered without TLS (what a client must refuse to use).

AUTH is Cyrus SASL against a sasldb holding ``USER``/``PASSWORD``. The certificate is
self-signed for 127.0.0.1 (``certificate``: trust it with ``ca_file``). Every domain is a virtual
mailbox domain and every recipient is delivered to one Maildir (``messages(address)`` picks
them by ``Delivered-To``) unless its local part starts with ``unknown``: Postfix refuses those
at RCPT (550 5.1.1). Received headers record TLS
and the authenticated user.

Postfix must run as root (it drops to its ``postfix`` user); anything missing fails the test
session with the reason, it never skips.
"""

import email.policy
import mailbox
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from email import message_from_bytes
from email.message import EmailMessage
from pathlib import Path

from tests.provider_stubs.smtp import self_signed_certificate

USER = "mailer"
PASSWORD = "s3cret-pw"
REALM = "postfix.test"
LISTENERS = ("plain", "legacy", "submission", "smtps", "cleartext_auth")
_POSTFIX = "/usr/sbin/postfix"
_SASLPASSWD = "/usr/sbin/saslpasswd2"
_QUEUES = ("maildrop", "incoming", "active", "deferred", "hold")

_MASTER_CF = """\
cleanup   unix  n       -       n       -       0       cleanup
qmgr      unix  n       -       n       300     1       qmgr
tlsmgr    unix  -       -       n       1000?   1       tlsmgr
rewrite   unix  -       -       n       -       -       trivial-rewrite
bounce    unix  -       -       n       -       0       bounce
defer     unix  -       -       n       -       0       bounce
trace     unix  -       -       n       -       0       bounce
verify    unix  -       -       n       -       1       verify
flush     unix  n       -       n       1000?   0       flush
proxymap  unix  -       -       n       -       -       proxymap
smtp      unix  -       -       n       -       -       smtp
showq     unix  n       -       n       -       -       showq
error     unix  -       -       n       -       -       error
retry     unix  -       -       n       -       -       error
discard   unix  -       -       n       -       -       discard
virtual   unix  -       n       n       -       -       virtual
anvil     unix  -       -       n       -       1       anvil
scache    unix  -       -       n       -       1       scache
postlog   unix-dgram n  -       n       -       1       postlogd
127.0.0.1:{plain} inet n - n - - smtpd
  -o smtpd_tls_security_level=none
127.0.0.1:{legacy} inet n - n - - smtpd
  -o smtpd_tls_security_level=none
  -o smtpd_discard_ehlo_keywords=8bitmime,smtputf8
127.0.0.1:{submission} inet n - n - - smtpd
  -o smtpd_tls_security_level=encrypt
  -o smtpd_sasl_auth_enable=yes
  -o smtpd_tls_auth_only=yes
127.0.0.1:{smtps} inet n - n - - smtpd
  -o smtpd_tls_wrappermode=yes
  -o smtpd_sasl_auth_enable=yes
127.0.0.1:{cleartext_auth} inet n - n - - smtpd
  -o smtpd_tls_security_level=none
  -o smtpd_sasl_auth_enable=yes
  -o smtpd_tls_auth_only=no
"""

_MAIN_CF = """\
compatibility_level = 3.6
queue_directory = {root}/queue
data_directory = {root}/data
maillog_file = {root}/maillog
maillog_file_prefixes = {root}
mail_owner = postfix
setgid_group = postdrop
myhostname = postfix.test
mydomain = postfix.test
mydestination =
relay_domains =
inet_interfaces = 127.0.0.1
inet_protocols = ipv4
mynetworks = 127.0.0.0/8
alias_maps =
alias_database =
biff = no
smtputf8_enable = yes
smtpd_banner = $myhostname ESMTP
smtpd_relay_restrictions = permit_mynetworks, reject_unauth_destination
virtual_mailbox_domains = static:all
virtual_mailbox_base = {root}/mail
virtual_mailbox_maps = regexp:{root}/config/mailboxes
virtual_uid_maps = static:{uid}
virtual_gid_maps = static:{gid}
virtual_minimum_uid = 1
smtpd_tls_cert_file = {root}/tls/cert.pem
smtpd_tls_key_file = {root}/tls/key.pem
smtpd_tls_received_header = yes
smtpd_tls_session_cache_database =
smtpd_sasl_type = cyrus
smtpd_sasl_path = smtpd
smtpd_sasl_local_domain = {realm}
smtpd_sasl_authenticated_header = yes
cyrus_sasl_config_path = {root}/config/sasl
"""

_SASL_CONF = """\
pwcheck_method: auxprop
auxprop_plugin: sasldb
mech_list: PLAIN LOGIN
sasldb_path: {root}/sasl/sasldb2
"""

# One Maildir for every recipient (Postfix refuses "$1" substitutions in mailbox paths; each
# message's Delivered-To names its recipient). Local parts starting with "unknown" find no
# mailbox: Postfix answers 550 5.1.1 at RCPT.
_MAILBOXES = "!/^unknown/\tinbox/\n"


@dataclass
class Postfix:
    """A running private instance; ``port(listener)``, ``wait_delivered(address)``."""

    root: Path
    ports: dict[str, int]
    certificate: Path
    started: bool = field(default=False)

    def port(self, listener: str) -> int:
        return self.ports[listener]

    def queue_empty(self) -> bool:
        queue = self.root / "queue"
        return not any(any(files) for d in _QUEUES for _, _, files in os.walk(queue / d))

    def messages(self, address: str) -> list[tuple[bytes, EmailMessage]]:
        """What is in ``address``'s Maildir: each message's raw bytes and its parse."""
        path = self.root / "mail" / "inbox"
        if not all((path / sub).is_dir() for sub in ("new", "cur", "tmp")):
            return []  # not yet made by the first delivery
        box = mailbox.Maildir(path, create=False)
        found = []
        for key in sorted(box.keys()):
            raw = box.get_bytes(key)
            # The modern parser reads UTF-8 headers (an SMTPUTF8 recipient) as text.
            message = message_from_bytes(raw, policy=email.policy.default)
            if str(message["Delivered-To"]).lower() == address.lower():
                found.append((raw, message))
        return found

    def wait_delivered(
        self, address: str, count: int = 1, timeout_s: float = 20.0
    ) -> list[tuple[bytes, EmailMessage]]:
        """Waits until ``address`` holds ``count`` messages and the queue is empty (so nothing
        more is on its way), then returns them; fails with the mail log's tail."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.messages(address)
            if len(found) >= count and self.queue_empty():
                return found
            time.sleep(0.02)  # a poll of the delivery's outcome, not a wait standing in for it
        raise AssertionError(
            f"{address}: {len(self.messages(address))} of {count} messages delivered in "
            f"{timeout_s}s; mail log:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        log = self.root / "maillog"
        return (
            "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""
        )

    def stop(self) -> None:
        if self.started:
            _run([_POSTFIX, "-c", str(self.root / "config"), "stop"])
            self.started = False
        shutil.rmtree(self.root, ignore_errors=True)


def _run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, **kwargs)  # type: ignore[call-overload]
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed ({result.returncode}): {result.stdout}{result.stderr}"
        )
    return result


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def start_postfix() -> Postfix:
    """Configures and starts a private instance; raises with the reason when it cannot."""
    for program in (_POSTFIX, _SASLPASSWD, shutil.which("openssl")):
        if program is None or not os.access(program, os.X_OK):
            raise RuntimeError(
                f"{program or 'openssl'} is missing: run `bash scripts/install_test_servers.sh`"
            )
    if os.geteuid() != 0:
        raise RuntimeError("the private Postfix must be started as root (it drops privileges)")
    owner = pwd.getpwnam("postfix")
    # Not under pytest's 0700 tmp tree: Postfix's own user must reach the mail and SASL files.
    root = Path(tempfile.mkdtemp(prefix="ep-postfix-"))
    root.chmod(0o755)
    for name in ("config", "queue", "data", "mail", "sasl", "tls"):
        (root / name).mkdir(mode=0o755)
    for name in ("data", "mail", "sasl"):
        os.chown(root / name, owner.pw_uid, owner.pw_gid)
    made = self_signed_certificate(root / "tls")
    assert made is not None
    made[0].rename(root / "tls" / "cert.pem")
    made[1].rename(root / "tls" / "key.pem")
    values = {"root": root, "uid": owner.pw_uid, "gid": owner.pw_gid, "realm": REALM}
    (root / "config" / "main.cf").write_text(_MAIN_CF.format(**values))
    (root / "config" / "sasl").mkdir()
    (root / "config" / "sasl" / "smtpd.conf").write_text(_SASL_CONF.format(**values))
    (root / "config" / "mailboxes").write_text(_MAILBOXES)
    sasldb = root / "sasl" / "sasldb2"
    _run([_SASLPASSWD, "-p", "-c", "-f", str(sasldb), "-u", REALM, USER], input=PASSWORD)
    os.chown(sasldb, owner.pw_uid, owner.pw_gid)
    server = Postfix(root, {}, root / "tls" / "cert.pem")
    try:
        for attempt in range(3):  # a freed port can be taken again before Postfix binds it
            server.ports = dict(zip(LISTENERS, _free_ports(len(LISTENERS)), strict=True))
            (root / "config" / "master.cf").write_text(_MASTER_CF.format(**server.ports))
            try:
                # `start` returns once the master has bound every listener (master -w).
                _run([_POSTFIX, "-c", str(root / "config"), "start"])
            except RuntimeError:
                if attempt == 2:
                    raise
                continue
            server.started = True
            return server
    except BaseException as exc:
        log = server.log_tail()
        server.stop()
        raise RuntimeError(f"the private Postfix did not start: {exc}\n{log}") from exc
    raise AssertionError("unreachable")
