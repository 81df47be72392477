"""What tracing costs when it is off: ``python -m bench.tracing``.

Each case runs in a fresh interpreter, in three setups: OpenTelemetry not installed (its import
blocked), installed with no tracer provider (the API's default), and an SDK provider with a
no-op span processor (tracing on, for scale). Cases: ``tracing.active()`` (what the send path
asks once per batch and the render asks per message), an empty ``with tracing.start_span(...)``
(the render's wrapper), ``tracing.publish_context`` (what ``publish()`` adds), against a bare
``nullcontext`` and an empty loop; and ``publish()`` itself on SQLite, per call. Prints one
table, nanoseconds per call (median of 5 runs).
"""

import subprocess
import sys

_CASES = r"""
import statistics, sys, tempfile, time
from contextlib import nullcontext
setup = sys.argv[1]
if setup == "missing":
    sys.modules["opentelemetry"] = None
elif setup == "sdk":
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    trace.set_tracer_provider(TracerProvider())
from email_platform import publish
from email_platform.observability import tracing
from email_platform.db.engine import make_engine, upgrade

N = 200_000
def per_call(fn, n=N):
    runs = []
    for _ in range(5):
        start = time.perf_counter_ns()
        fn(n)
        runs.append((time.perf_counter_ns() - start) / n)
    return statistics.median(runs)

def loop(n):
    for _ in range(n):
        pass
def bare(n):
    for _ in range(n):
        with nullcontext():
            pass
def active(n):
    for _ in range(n):
        tracing.active()
def span(n):
    for _ in range(n):
        with tracing.start_span("x", context_carrier=None, attributes={"a": 1}):
            pass
def context(n):
    for _ in range(n):
        tracing.publish_context(0, {"a": 1})

engine = make_engine(f"sqlite:///{tempfile.mkdtemp()}/bench.sqlite3")
upgrade(engine)
def publishes(n):
    with engine.begin() as connection:
        for i in range(n):
            publish(connection, event_type="user.signed_up", aggregate_id=f"u{i}",
                    payload={"user_id": f"u{i}", "email": f"u{i}@example.com", "first_name": "U"})

results = {"empty loop": per_call(loop), "nullcontext": per_call(bare),
           "active()": per_call(active), "start_span (empty block)": per_call(span),
           "publish_context": per_call(context), "publish() on SQLite": per_call(publishes, 2000)}
for name, ns in results.items():
    print(f"{name}\t{ns:.0f}")
"""

SETUPS = ("missing", "no provider", "sdk")


def main() -> None:
    table: dict[str, dict[str, str]] = {}
    for setup in SETUPS:
        out = subprocess.run(
            [sys.executable, "-c", _CASES, setup], capture_output=True, text=True, check=True
        ).stdout
        for line in out.strip().splitlines():
            name, ns = line.split("\t")
            table.setdefault(name, {})[setup] = ns
    print(f"{'ns per call':<28}" + "".join(f"{s:>16}" for s in SETUPS))
    for name, row in table.items():
        print(f"{name:<28}" + "".join(f"{row[s]:>16}" for s in SETUPS))


if __name__ == "__main__":
    main()
