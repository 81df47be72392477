"""Analytics assets (DuckDB). The funnel lands with the analytics work; see analytics/."""

analytics_assets: list = []
