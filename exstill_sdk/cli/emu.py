"""exstill-emu: serve the card runtime on a TCP port, as a card would on its link."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import logging
import signal
import sys
import threading
from typing import Any
from urllib.parse import urlsplit

from exstill_firmware.emulator import CardOptions
from exstill_firmware.engines import BUILTIN_ENGINES

from exstill_sdk.auth import load_admin_key
from exstill_sdk.cli.support import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    Parser,
    UsageError,
    fail,
)
from exstill_sdk.errors import ExstillError

EXIT_POWER_CUT = 75
"""exstill-emu's own: the fault-injection power cut (--power-cut-after) happened."""


CARD = CardOptions()
"""A card's defaults, shared with emu:// URLs."""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="exstill-emu",
        description="Run the Exstill card runtime on this CPU and serve it on a TCP port. "
        "The first line of stdout is the URL to pass to open_card() (port 0 picks a free one).",
    )
    p.add_argument(
        "--listen",
        default="tcp://127.0.0.1:0",
        help="tcp://HOST:PORT to serve on (default tcp://127.0.0.1:0: loopback, a free port)",
    )
    p.add_argument(
        "--serial",
        choices=["pty"],
        help="serve on a serial line instead: 'pty' opens a pseudo-terminal pair and prints "
        "its serial:// URL",
    )
    p.add_argument(
        "--streams", type=int, default=CARD.slots, help=f"stream slots (default {CARD.slots})"
    )
    p.add_argument(
        "--context",
        type=int,
        default=CARD.context,
        help=f"tokens per slot (default {CARD.context})",
    )
    p.add_argument(
        "--engine",
        action="append",
        choices=sorted(BUILTIN_ENGINES),
        help=f"built-in engine to load (repeatable; default: {', '.join(CARD.engines)})",
    )
    p.add_argument(
        "--image",
        action="append",
        default=[],
        help="card image to load as a target (repeatable); checked in full first",
    )
    p.add_argument(
        "--trusted-keys",
        help="directory of trusted *.pub keys: refuse images not signed by one of them",
    )
    p.add_argument("--store", help="image store directory (flashed targets; survives restarts)")
    p.add_argument(
        "--store-max-mb",
        type=float,
        metavar="MB",
        help="store capacity: refuse uploads that would not fit (STORE_FULL); default unlimited",
    )
    p.add_argument(
        "--power-cut-after",
        type=int,
        metavar="BYTES",
        help="fault injection: cut power once the store has written BYTES bytes",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=CARD.threads,
        help="compute threads per transformer engine (default 0: one per core)",
    )
    p.add_argument(
        "--max-k",
        type=int,
        default=CARD.max_k,
        help=f"largest K a stream may ask for (default {CARD.max_k})",
    )
    p.add_argument(
        "--admin-key",
        metavar="FILE",
        help="the secret a TCP client must prove (HMAC of a fresh nonce) before it may change "
        "the image store; without it, TCP clients cannot (make one: exstill-flash --new-key)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="serve clients on other hosts without the admin key (drafting only); by default a "
        "non-loopback --listen needs --admin-key",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=64,
        help="TCP connections served at once; more are answered CARD_FULL (default 64)",
    )
    p.add_argument("--no-prefetch", action="store_true", help="disable next-draft prefetch")
    p.add_argument(
        "--no-outcomes",
        action="store_true",
        help="prefetch for full acceptance only, not for the other likely verification outcomes",
    )
    p.add_argument(
        "--poll-ms",
        type=float,
        default=0.0,
        help="after each reply, poll the link this long before sleeping, as a card's firmware "
        "does (a woken process can take hundreds of us to run on a shared machine); spends "
        "the core it runs on, so give the emulator a core of its own (default 0: sleep)",
    )
    p.add_argument(
        "--cards",
        type=int,
        default=1,
        help="serve this many cards, each on its own port (the next ones after --listen's, or "
        "free ones for port 0); the first line is then their pool URL (default 1)",
    )
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve the cards' telemetry as Prometheus metrics over HTTP at /metrics (port 0 "
        "takes a free one; the address is printed on stderr)",
    )
    p.add_argument("--json", action="store_true", help="print the first line as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="log connections to stderr")
    return p


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve_metrics(listen: str, runtimes: list[Any], servers: list[Any]) -> str:
    """Each card's telemetry as Prometheus metrics (exstill_sdk.metrics.prometheus), labelled
    by the card's URL, served over HTTP from a thread; returns HOST:PORT."""
    from prometheus_client import CollectorRegistry, start_http_server

    from exstill_sdk.metrics.prometheus import CardCollector

    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--metrics-listen wants HOST:PORT, not {listen!r}")
    registry = CollectorRegistry()
    for runtime, server in zip(runtimes, servers, strict=True):
        registry.register(CardCollector(runtime.stats, server.url))
    http, _thread = start_http_server(int(port), host.strip("[]"), registry=registry)
    return f"{host}:{http.server_port}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        stream=sys.stderr,
        format="exstill-emu: %(message)s",
    )
    from exstill_firmware.emulator import PtyCardServer, TcpCardServer, build_runtime

    listen = urlsplit(args.listen)
    try:
        if listen.scheme != "tcp" or not listen.hostname or listen.port is None:
            raise UsageError(f"--listen wants tcp://HOST:PORT, not {args.listen!r}")
        admin_key = load_admin_key(args.admin_key) if args.admin_key else None
        if not args.serial and not _loopback(listen.hostname) and not (admin_key or args.insecure):
            raise UsageError(
                f"--listen {args.listen} lets other hosts reach the card, and without an admin "
                "key anyone who can connect could use it: give --admin-key FILE (make one with "
                "exstill-flash --new-key FILE), or --insecure to serve drafting to anyone"
            )
        if args.cards < 1:
            raise UsageError(f"--cards must be at least 1, not {args.cards}")
        if args.cards > 1 and (args.serial or args.store or args.power_cut_after):
            raise UsageError(
                "--cards serves TCP cards without an image store: for --serial, --store or "
                "--power-cut-after run one exstill-emu per card"
            )
        options = CardOptions(
            slots=args.streams,
            context=args.context,
            engines=tuple(args.engine or CARD.engines),
            images=tuple(args.image),
            max_k=args.max_k,
            prefetch=not args.no_prefetch,
            prefetch_outcomes=not args.no_outcomes,
            threads=args.threads,
            store=args.store,
            store_max_bytes=None if args.store_max_mb is None else int(args.store_max_mb * 2**20),
            trusted_keys=args.trusted_keys,
            power_cut_after=args.power_cut_after,
            admin_key=admin_key,
        )
        # the server runs prefetch work between requests
        runtimes = [build_runtime(options, background_prefetch=False) for _ in range(args.cards)]
        servers: list[TcpCardServer | PtyCardServer] = [
            PtyCardServer(runtime)
            if args.serial
            else TcpCardServer(
                runtime,
                listen.hostname,
                listen.port and listen.port + i,
                args.max_connections,
                remote_needs_key=not args.insecure,
                poll_s=args.poll_ms / 1e3,
            )
            for i, runtime in enumerate(runtimes)
        ]
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            reason = {
                errno.EADDRINUSE: "is in use",
                errno.EADDRNOTAVAIL: "is not an address of this machine",
                errno.EACCES: "needs more privileges",
            }[exc.errno]
            busy = UsageError(
                f"--listen {args.listen}: the address {reason}; choose another (port 0 takes "
                "a free one)"
            )
            return fail("exstill-emu", busy, args.json)
        return fail("exstill-emu", exc, args.json)
    except ExstillError as exc:
        return fail("exstill-emu", exc, args.json)
    url = ",".join(server.url for server in servers)
    if args.metrics_listen:
        try:
            metrics_at = serve_metrics(args.metrics_listen, runtimes, servers)
        except (OSError, UsageError) as exc:
            for runtime in runtimes:
                runtime.shutdown()
            return fail("exstill-emu", exc, args.json)
        print(f"exstill-emu: metrics at http://{metrics_at}/metrics", file=sys.stderr, flush=True)
    if args.json:
        server = servers[0]
        where = (
            {"path": server.path}
            if isinstance(server, PtyCardServer)
            else {"host": server.host, "port": server.port}
        )
        cards = {"cards": [server.url for server in servers]} if len(servers) > 1 else {}
        print(json.dumps({"url": url, **where, **cards}), flush=True)
    else:
        print(url, flush=True)

    interrupted = []

    def _stop(signum: int, frame: object) -> None:
        if signum == signal.SIGINT:
            interrupted.append(signum)
        for server in servers:
            server.stop()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers[1:]]
    try:
        for thread in threads:
            thread.start()
        servers[0].serve_forever()
    finally:
        for server in servers[1:]:
            server.stop()
        for thread in threads:
            thread.join(5)
        for runtime in runtimes:
            runtime.shutdown()
    if getattr(servers[0], "powered_off", False):
        print("exstill-emu: power cut (fault injection)", file=sys.stderr)
        return EXIT_POWER_CUT
    frames = rounds = 0
    for runtime in runtimes:
        stats = runtime.telemetry.snapshot(0)
        frames, rounds = frames + stats["frames"], rounds + stats["rounds"]
    how = "interrupted; " if interrupted else ""
    print(f"exstill-emu: {how}stopped after {frames} frames, {rounds} rounds", file=sys.stderr)
    return EXIT_INTERRUPTED if interrupted else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
