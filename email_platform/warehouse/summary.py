"""``RefreshSummary``: what one refresh did. Its own module because ``refreshing`` fills it
and ``state`` reads it, and ``refreshing`` imports ``state``."""

from dataclasses import dataclass, field
from datetime import datetime


@dataclass
class RefreshSummary:
    """What one refresh did: rows read and written per source, the build, the timings."""

    warehouse_path: str
    full_build: bool
    rows_read: dict[str, int] = field(default_factory=dict)
    rows_loaded: dict[str, int] = field(default_factory=dict)
    # Loaded rows removed because the source deleted them (provider events: see DELETIONS).
    rows_removed: dict[str, int] = field(default_factory=dict)
    high_water_marks: dict[str, datetime | None] = field(default_factory=dict)
    messages_rebuilt: int = 0
    # Of those, the funnel rows folded from only the loaded rows (see ``fold``).
    messages_folded: int = 0
    days_rebuilt: int = 0
    # The daily rows rewritten (the touched days') and the funnel rows re-aggregated into
    # them; a full build's slices.
    daily_rows_changed: int = 0
    # Of those, the rows of days only steady folded rows reached (see ``fold``).
    daily_rows_kept: int = 0
    daily_rows_read: int = 0
    slices: int = 0
    # Rows deleted to replace them (loaded rows that changed, rebuilt funnel and daily rows).
    rows_deleted: int = 0
    table_rows: dict[str, int] = field(default_factory=dict)
    timings_s: dict[str, float] = field(default_factory=dict)
    funnel: dict[str, float | int | None] = field(default_factory=dict)
    # How the next refresh's writer file was made: "patched" (the replaced snapshot) or
    # "copied" (see prepare_next_writer).
    next_writer: str | None = None
    # Whether deleted rows were compacted out of the writer file after publishing (compact).
    compacted: bool = False
    started_at: datetime | None = None
    finished_at: datetime | None = None

    @property
    def total_loaded(self) -> int:
        return sum(self.rows_loaded.values())
