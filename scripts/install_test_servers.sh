#!/usr/bin/env bash
# Installs the servers the test suite runs privately (tests/servers/): Postfix with Cyrus SASL
# (sasldb, for AUTH) and openssl (the test certificate). Idempotent and non-interactive: apt runs
# only when something is missing, so a prepared machine pays nothing. Debian/Ubuntu, as root.
set -euo pipefail

missing=()
command -v postfix >/dev/null 2>&1 || [ -x /usr/sbin/postfix ] || missing+=(postfix)
command -v saslpasswd2 >/dev/null 2>&1 || [ -x /usr/sbin/saslpasswd2 ] || missing+=(sasl2-bin)
# The PLAIN/LOGIN mechanisms and the sasldb auxprop plugin Postfix's smtpd loads.
ls /usr/lib/*/sasl2/libplain.so* >/dev/null 2>&1 || missing+=(libsasl2-modules)
ls /usr/lib/*/sasl2/libsasldb.so* >/dev/null 2>&1 || missing+=(libsasl2-modules-db)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)

if [ "${#missing[@]}" -eq 0 ]; then
  echo "test servers: postfix, sasl2-bin, openssl already installed"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "test servers: missing ${missing[*]}; run this script as root (apt-get)" >&2
  exit 1
fi
echo "test servers: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Postfix asks how it should run; the tests use their own instance, the system one stays local.
echo "postfix postfix/main_mailer_type select Local only" | debconf-set-selections
echo "postfix postfix/mailname string localhost" | debconf-set-selections
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
