"""Alerts: conditions read from the operational tables, raised once and resolved when they end."""
