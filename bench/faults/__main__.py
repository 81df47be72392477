"""``python -m bench.faults``: drain a stream of events through the real stack while faults are
injected, settle, then count every event's fate. Last line: ``lost=N doubled=N wrong=N``; the
exit status is non-zero unless all three are 0.

    python -m bench.faults                                   # small: 300 events, SQLite
    python -m bench.faults --database postgres --mode batch
    python -m bench.faults --events 20000 --kill-every-s 2 --database postgres  # the large run
    python -m bench.faults --keyless                         # the accept-then-die window
"""

import argparse
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.faults import program, webhooks
from bench.faults.checker import Verdict, check
from bench.faults.kills import KINDS, KillSchedule, Supervisor
from bench.faults.stack import Stack, StackSettings
from bench.faults.stream import Stream
from email_platform.store import outbox


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__)
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--per-s", type=float, default=40.0, help="publish rate")
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--mode", choices=["workers", "batch"], default="workers")
    parser.add_argument("--kill-every-s", type=float, default=3.0, help="0: no kills")
    parser.add_argument(
        "--kill-kinds",
        help=f"default: {','.join(KINDS)}; without step in batch mode (its runs have none)",
    )
    parser.add_argument(
        "--kill-tail-s", type=float, default=20.0, help="kills go on this long after publishing"
    )
    parser.add_argument("--outage-s", type=float, default=8.0, help="provider 503 for this long")
    parser.add_argument("--db-down-s", type=float, default=5.0, help="PostgreSQL absent this long")
    parser.add_argument("--lock-s", type=float, default=5.0, help="outbox locked this long")
    parser.add_argument("--settle-s", type=float, default=300.0)
    parser.add_argument("--keyless", action="store_true", help="a provider without keys")
    parser.add_argument("--no-webhooks", action="store_true")
    parser.add_argument(
        "--hostile-webhooks", type=int, default=6, help="hostile posts of each kind after the drain"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--poison-share", type=float, default=0.01)
    parser.add_argument("--workdir", type=Path)
    return parser.parse_args(argv)


FATES = ("lost", "doubled", "wrong")


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def outstanding(stack: Stack, event_ids: list[str]) -> int:
    with stack.engine.connect() as connection:
        counts = outbox.counts_for(connection, event_ids)
    return counts.get("pending", 0) + counts.get("in_flight", 0)


def settle(stack: Stack, stream: Stream, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    last = 0.0
    while time.monotonic() < deadline:
        left = outstanding(stack, list(stream.expected.fates))
        if time.monotonic() - last > 10:
            say(f"  settling: {left} event(s) not finished")
            last = time.monotonic()
        if left == 0:
            return True
        time.sleep(1.0)
    return False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="faults_"))
    if workdir.exists() and any(workdir.iterdir()):
        say(f"{workdir} is not empty: a drain starts from nothing")
        return 2

    # Torn down on SIGTERM too: a killed harness must not leave its stack running. Only the
    # first signal counts (``timeout`` forwards one more), so the teardown is not cut short.
    def terminate(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    signal.signal(signal.SIGTERM, terminate)
    settings = StackSettings(
        workdir=workdir,
        database=args.database,
        mode=args.mode,
        seed=args.seed,
        idempotency=not args.keyless,
        # Without keys a lost answer after acceptance doubles by design: measure only the window.
        rate_accept_timeout=0.0 if args.keyless else 0.002,
        rate_accept_reset=0.0 if args.keyless else 0.002,
        webhooks=not args.no_webhooks,
    )
    started = time.monotonic()
    say(f"faults: {args.events} events, {args.database}, {args.mode} mode, work in {workdir}")
    stack = Stack(settings).start()
    say(f"  stack up in {time.monotonic() - started:.0f}s")
    stream = Stream(
        stack.engine,
        args.events,
        args.per_s,
        args.seed,
        keyless=args.keyless,
        poison_share=args.poison_share,
    )
    supervisor = Supervisor(stack).start()
    if args.kill_kinds is None:
        kinds = tuple(k for k in KINDS if args.mode == "workers" or k != "step")
    else:
        kinds = tuple(k for k in args.kill_kinds.split(",") if k)
    kills = KillSchedule(stack, args.kill_every_s, rng, kinds)
    faults = program.FaultProgram(stack)
    publish_s = args.events / args.per_s
    faults.at(
        publish_s * 0.15, "provider_outage", lambda: program.provider_outage(stack, args.outage_s)
    )
    faults.at(publish_s * 0.3, "outbox_locked", lambda: program.outbox_locked(stack, args.lock_s))
    if args.database == "postgres":
        faults.at(
            publish_s * 0.45, "database_restart", lambda: program.database_restart(stack, 1.0)
        )
        faults.at(
            publish_s * 0.6,
            "database_unreachable",
            lambda: program.database_restart(stack, args.db_down_s),
        )
    for share in (0.2, 0.5, 0.8):
        faults.at(publish_s * share, "late_commit", lambda: program.late_commit(stack, stream))
    faults.at(publish_s * 0.4, "extra_batch_run", lambda: program.extra_batch_run(stack))
    verdict = Verdict()
    stats: dict = {"faults": {}, "accepted": 0, "repeated_keys": 0}
    hooks: tuple | None = None
    settled = False
    try:
        kills.start()
        faults.start()
        publisher = threading.Thread(target=stream.run, name="publish")
        publisher.start()
        publisher.join()
        faults.wait()
        say(f"  published {len(stream.expected.fates)} in {time.monotonic() - started:.0f}s")
        time.sleep(args.kill_tail_s)
        kills.stop()
        say(f"  kills stopped after {sum(kills.killed.values())}; settling")
        settled = settle(stack, stream, args.settle_s)
        # After recovery an operator replays what the outage exhausted, twice at once.
        if program.replay_twice_at_once(stack):
            faults.done["reexecute_twice_beside_replays"] += 1
        faults.done["replay_twice_at_once"] += 1
        settled = settle(stack, stream, args.settle_s) and settled
        accepted = httpx.get(f"{stack.sandbox.base_url}/_sandbox/messages", timeout=60).json()
        stats = httpx.get(f"{stack.sandbox.base_url}/_sandbox/stats", timeout=60).json()
        verdict = check(
            stack.engine,
            stream.expected,
            accepted["messages"],
            stats["repeated_keys"],
            keyless=args.keyless,
        )
        if not args.no_webhooks:
            say("  hostile webhooks, the receiver killed meanwhile")
            hooks = program.hostile_webhooks(stack, rng, args.hostile_webhooks, args.settle_s)
            faults.done["hostile_webhooks"] += 1
            verdict.add_webhooks(hooks[2], hooks[0])
    finally:
        kills.stop()
        supervisor.stop()
        stack.stop()
    report(
        args,
        stream,
        kills,
        supervisor,
        faults,
        stats,
        verdict,
        settled,
        time.monotonic() - started,
        hooks,
    )
    return 0 if verdict.lost == verdict.doubled == verdict.wrong == 0 else 1


def report(  # type: ignore[no-untyped-def]
    args, stream, kills, supervisor, faults, stats, verdict, settled, elapsed_s, hooks
) -> None:
    expected = stream.expected
    print(f"command: python -m bench.faults {' '.join(sys.argv[1:])}")
    print(
        f"database={args.database} mode={args.mode} events={len(expected.fates)} "
        f"publish_refused={expected.refused} settled={settled} elapsed_s={elapsed_s:.0f}"
    )
    print("published: " + " ".join(f"{k}={v}" for k, v in sorted(expected.kinds.items())))
    print(
        f"kills: total={sum(kills.killed.values())} skipped={kills.skipped} "
        + " ".join(f"{k}={v}" for k, v in sorted(kills.killed.items()))
    )
    print("faults: " + " ".join(f"{k}={v}" for k, v in sorted(faults.done.items())))
    print(
        "provider: "
        + " ".join(f"{k}={v}" for k, v in sorted(stats["faults"].items()) if v)
        + f" accepted={stats['accepted']} replayed_keys={stats['repeated_keys']}"
    )
    print("fates: " + " ".join(f"{k}={v}" for k, v in sorted(verdict.fates.items())))
    if hooks is not None:
        counts, receiver_kills, found = hooks
        print(
            f"webhooks: planned={found.counts['planned']} applied={found.counts['email_events']} "
            f"messages={found.counts['messages']} "
            f"suppressions={found.counts['suppressions_expected']} "
            f"receiver_kills={receiver_kills} inbox_settled={bool(counts['inbox_settled'])} "
            + " ".join(
                f"{kind}={counts[kind]}"
                for kind in (*webhooks.HOSTILE_KINDS, *webhooks.ALARMS)
                if kind in counts
            )
        )
        findings = {k: v for k, v in found.counts.items() if k.split(":")[0] in FATES}
        if findings:
            print("webhook findings: " + " ".join(f"{k}={v}" for k, v in sorted(findings.items())))
    print("restarts: " + " ".join(f"{k}={v}" for k, v in sorted(supervisor.restarts.items())))
    for problem in supervisor.errors:
        print(f"restart failed (tried again): {problem}")
    for problem in [*kills.errors, *faults.errors]:
        print(f"harness error: {problem}")
    for detail in verdict.details:
        print(f"  {detail}")
    if args.keyless:
        why = verdict.accepted_twice
        print(
            f"accept_then_die_window: {sum(why.values())} message(s) accepted twice: "
            f"{why['unrecorded']} with no outcome recorded between acceptance and commit "
            f"(sender killed, database gone), {why['after_timeout']} after a client timeout"
        )
    print(verdict.line)


if __name__ == "__main__":
    sys.exit(main())
