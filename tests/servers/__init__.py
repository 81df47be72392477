"""Real servers the tests run privately (installed by scripts/install_test_servers.sh)."""
