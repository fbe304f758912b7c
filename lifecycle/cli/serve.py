"""``residency serve``: one process serving one pipeline on one device over HTTP.

    residency serve [--host 127.0.0.1] [--port 30000] [--pipeline demo|MODULE:FACTORY]
        [--size 64MB] [--residency ... | --device-budget 20GiB] [--device cpu|cuda|cuda:N]
        [--host-budget 64GiB|80%|auto] [--pin-budget 16GiB|auto] [--checkpoint DIR]
        [--api-key KEY]
        [--auto-wake] [--drain-timeout S] [--log-json] [--discard-on-release all|NAMES]
        [--header-timeout S] [--body-timeout S] [--max-connections N] [--fd-timeout S]
        [--allow-process-groups] [--trainer-networks CIDR[,CIDR]]

``--pipeline MODULE:FACTORY`` imports ``MODULE`` and calls ``FACTORY()``, which returns a
pipeline (anything ``attach()`` takes) or ``(pipeline, generate)`` with ``generate`` an
``async (ctl, body) -> dict`` serving ``/generate``. The pipeline is attached when the server
starts and detached when it stops. SIGTERM or SIGINT: stop accepting, let requests in flight
finish (at most ``--drain-timeout`` seconds), detach, exit 0; a second signal exits at once.

``--discard-on-release all|NAMES`` (comma-separated component names) makes every
``/release_memory_occupation`` drop those components' weights without a host copy (the
controller's ``discard_on_release``; the reference's clients send ``{}``): they are stale
from then on and, once resumed, serve nothing until updates write every tensor; a release
body's ``"discard"`` overrides it per call. Names the pipeline lacks are bad usage (exit 2).

``--host-budget`` caps the host bytes the server's weights may hold (mirrors, and the
transient buffers of a move); a release, residency change or update that would pass it is
refused before it allocates (HostBudgetExceeded, 507), nothing changed. A size is the node's:
with ``--nproc N`` each rank gets 1/N; a percentage or ``auto`` is of what the process's
cgroups and ``/proc/meminfo`` leave (``auto``: less a reserve), split between the node's
ranks (``LOCAL_WORLD_SIZE``). ``--pin-budget`` caps the page-locked part (default: the host
budget); mirrors past it are pageable. ``--checkpoint DIR``: the safetensors files the
pipeline's weights were loaded from (``DIR/<component>/*.safetensors``), checked at start:
the components they cover keep no host copy while released and are read back at resume.

An empty ``--api-key`` (or ``RESIDENCY_API_KEY``) is bad usage (it would admit an empty token);
binding an address other than loopback without a key prints a warning. Slow clients are bounded
(see :mod:`lifecycle.http._server`): ``--header-timeout`` seconds for a request's headers,
``--body-timeout`` seconds without a byte of a body, ``--max-connections`` open at once.

The weight update group routes make the server connect to a trainer the client names: they
are served with ``--api-key`` or ``--allow-process-groups`` (else 403), and only to a
``master_address`` in ``--trainer-networks`` (loopback by default).
"""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import os
import socket
import sys
import threading
from types import FrameType
from typing import Any

from lifecycle import CheckpointMismatch, InfeasibleBudget, LifecycleController, configure_logging
from lifecycle._discard import resolve_discard
from lifecycle._hostbudget import HostLimits, derive_budgets, local_world_size
from lifecycle._pipeline import components_of
from lifecycle._units import parse_size
from lifecycle._weight_sync import WeightSyncLimits, warm_up
from lifecycle.demo import DemoPipeline

__all__ = ["add_arguments", "load_pipeline", "run"]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``residency serve``."""
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    ap.add_argument("--port", type=int, default=30000, help="port (0: any free one)")
    ap.add_argument("--pipeline", default="demo", help="'demo' or MODULE:FACTORY")
    ap.add_argument("--size", default="64MB", help="demo pipeline weight size")
    ap.add_argument("--residency", help="component residency, e.g. 'vae=component-offload'")
    ap.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    ap.add_argument("--device-budget",
                    help="plan the residency at start under this many device bytes for weights "
                         "('20GiB', '90%%' of free memory); replaces --residency")
    ap.add_argument("--host-budget", type=_budget,
                    help="host bytes the weights may hold on this node ('64GiB', split over "
                         "--nproc ranks; '80%%' or 'auto' of what the cgroup and the machine "
                         "leave); past it releases and updates are refused (default: no cap)")
    ap.add_argument("--pin-budget", type=_budget,
                    help="page-locked host bytes on this node (same syntax; default: the host "
                         "budget); mirrors past it are pageable")
    ap.add_argument("--checkpoint", metavar="DIR",
                    help="the safetensors files the weights were loaded from "
                         "(DIR/<component>/*.safetensors): while released, the components "
                         "they cover hold no host copy and are read back at resume")
    ap.add_argument("--api-key", default=os.environ.get("RESIDENCY_API_KEY"),
                    help="require 'Authorization: Bearer KEY' (default $RESIDENCY_API_KEY)")
    ap.add_argument("--auto-wake", action="store_true",
                    help="a generation while sleeping wakes the pipeline (once) instead of 400")
    ap.add_argument("--drain-timeout", type=float, default=30.0,
                    help="seconds a release/update or a shutdown waits for work in flight")
    ap.add_argument("--log-json", action="store_true", help="log JSON lines on stderr")
    ap.add_argument("--discard-on-release", type=_discard_names, metavar="all|NAMES",
                    help="every /release_memory_occupation drops these components' weights "
                         "(comma-separated names, or 'all') without a host copy; resumed, they "
                         "serve nothing until updates write every tensor. A release "
                         "body's \"discard\" (true, false, \"all\", [names]) overrides it")
    ap.add_argument("--nproc", type=int, default=1,
                    help="rank processes on this machine (rank 0 serves HTTP); under torchrun "
                         "RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT are read instead")
    ap.add_argument("--collective-timeout", type=float, default=30.0,
                    help="seconds a collective waits for the other ranks")
    ap.add_argument("--header-timeout", type=_seconds, default=10.0,
                    help="seconds a request's line and headers may take to arrive, from the "
                         "connection's start or the request's first byte (then 408)")
    ap.add_argument("--body-timeout", type=_seconds, default=30.0,
                    help="seconds a request body may go without a byte (then 408)")
    ap.add_argument("--max-connections", type=_count, default=256,
                    help="connections open at once; past it a new one gets 503 (0: no limit)")
    ap.add_argument("--allow-process-groups", action="store_true",
                    help="serve the weight update group routes (/init_weights_update_group, "
                         "/update_weights_from_distributed, /destroy_weights_update_group) "
                         "without --api-key (with a key they are served; without either, 403)")
    ap.add_argument("--trainer-networks", type=_networks, default=("127.0.0.0/8", "::1/128"),
                    metavar="CIDR[,CIDR]",
                    help="networks a weight update group's master_address may be in "
                         "(default loopback: 127.0.0.0/8,::1/128)")
    ap.add_argument("--fd-timeout", type=_seconds, default=5.0,
                    help="seconds each step of a pickled upload's file-descriptor handshake "
                         "with its sender may take (then 400)")


def _budget(text: str) -> str:
    """``--host-budget`` / ``--pin-budget``: a size, a percentage or ``auto`` (checked now)."""
    try:
        derive_budgets(text, limits=HostLimits(total=1, available=1))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _networks(text: str) -> tuple[str, ...]:
    """``--trainer-networks``: comma-separated networks (``10.0.0.0/8``) or addresses."""
    nets = tuple(n.strip() for n in text.split(","))
    for net in nets:
        try:
            ipaddress.ip_network(net, strict=False)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be comma-separated networks such as "
                                             f"10.0.0.0/8 or addresses, got {net!r}") from None
    return nets


def _discard_names(text: str) -> str | list[str]:
    """``--discard-on-release``: ``"all"`` or the component names (checked at start)."""
    if text.strip() == "all":
        return "all"
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"must be 'all' or comma-separated component names, "
                                         f"got {text!r}")
    return names


def _check_discard(discard: str | list[str], pipe: Any) -> None:
    """ValueError naming the valid components when ``--discard-on-release`` names one ``pipe``
    lacks. Checked on every rank before any joins the group (all exit 2 alike); a pipeline
    without components is left to ``attach``, which says what is wrong with it."""
    try:
        components = components_of(pipe)
    except (TypeError, ValueError):
        return
    try:
        resolve_discard(discard, components)
    except ValueError as exc:
        raise ValueError(f"--discard-on-release: {exc}") from None


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_pipeline(spec: str, size: str) -> tuple[Any, Any, str]:
    """``(pipeline, generate or None, description)`` for ``--pipeline``."""
    from lifecycle.http import demo_generate

    if spec == "demo":
        pipe = DemoPipeline.build(parse_size(size))
        return pipe, demo_generate(pipe), f"demo ({pipe.nbytes / 2**20:.1f} MiB)"
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--pipeline must be 'demo' or MODULE:FACTORY, got {spec!r}")
    factory = getattr(importlib.import_module(module_name), attr)
    made = factory()
    pipe, generate = made if isinstance(made, tuple) else (made, None)
    return pipe, generate, spec


def _launch(args: argparse.Namespace) -> int:
    """``--nproc N``: start N rank processes of this same command, forward SIGTERM/SIGINT
    to rank 0 (which stops the others), and exit 0 when every rank exited 0."""
    import signal
    import subprocess

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    procs = []
    for rank in range(args.nproc):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(args.nproc),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(args.nproc),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "lifecycle", *sys.argv[1:]],
                                      env=env))

    def forward(sig: int, frame: FrameType | None) -> None:
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    codes = [p.wait() for p in procs]
    return 0 if all(c == 0 for c in codes) else 1


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean shutdown, 2 on bad usage."""
    if args.api_key is not None and not args.api_key.strip():
        print("residency serve: --api-key (or RESIDENCY_API_KEY) is empty; it would admit "
              "'Authorization: Bearer ' with no token. Give a key, or unset it to serve "
              "without one", file=sys.stderr)
        return 2
    if args.nproc > 1 and "RANK" not in os.environ:
        return _launch(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.api_key is None and not _loopback(args.host) and int(os.environ.get("RANK", "0")) == 0:
        print(f"residency serve: warning: {args.host} is not a loopback address and there is no "
              "--api-key: anyone who can reach the port can release, resume and replace the "
              "weights", file=sys.stderr, flush=True)
    try:
        import uvicorn

        from lifecycle.http import ServerLimits, create_app, uvicorn_config
    except ImportError as exc:  # the launchers install the extra
        print(f"residency serve needs the 'serve' extra: pip install 'residency[serve]' ({exc})",
              file=sys.stderr)
        return 2
    try:
        pipe, generate, described = load_pipeline(args.pipeline, args.size)
        discard = getattr(args, "discard_on_release", None)
        if discard is not None:
            _check_discard(discard, pipe)
        group = _join_group(args) if world > 1 else None
        if args.device_budget is not None and args.residency not in (None, "auto"):
            raise ValueError("--device-budget plans the residency: leave out --residency")
        residency = "auto" if args.device_budget is not None else args.residency
        # Sizes given are the node's: each rank holds its share (a percentage or 'auto' is
        # split by the controller).
        ranks = local_world_size(args.nproc if "LOCAL_WORLD_SIZE" not in os.environ else None)
        host_budget, pin_budget = (
            _per_rank(getattr(args, "host_budget", None), ranks),
            _per_rank(getattr(args, "pin_budget", None), ranks))
        ctl = LifecycleController(args.device, residency=residency,
                                  device_budget=args.device_budget,
                                  host_budget=host_budget, pin_budget=pin_budget,
                                  local_world_size=ranks,
                                  drain_timeout=args.drain_timeout, auto_wake=args.auto_wake,
                                  process_group=group,
                                  collective_timeout=args.collective_timeout,
                                  discard_on_release=discard,
                                  weight_sync_limits=WeightSyncLimits(
                                      trainer_networks=tuple(args.trainer_networks)))
    except (ValueError, ImportError, AttributeError) as exc:
        print(f"residency serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(json=args.log_json, level="info")
    if args.api_key is not None or args.allow_process_groups:  # a first init need not wait
        threading.Thread(target=warm_up, name="residency-fork-server", daemon=True).start()
    checkpoint = getattr(args, "checkpoint", None)
    driver = None
    if world > 1:
        from lifecycle.http._channel import OpChannel
        from lifecycle.http._driver import LocalDriver
        from lifecycle.http._ranks import RankDriver, follow

        rank = int(os.environ["RANK"])
        channel = OpChannel(_op_store(args, world), rank, world)
        local = LocalDriver(ctl, generate)
        if rank != 0:
            async def serve_rank() -> None:
                await ctl.attach(pipe, checkpoint=checkpoint)  # collective: with rank 0's
                await follow(ctl, local, channel)

            import anyio

            anyio.run(serve_rank)
            return 0
        driver = RankDriver(local, channel, timeout=args.drain_timeout + 60)
    # IPPROTO_TCP: asyncio then sets TCP_NODELAY on each connection (with proto 0 it does not,
    # and every response waited 40 ms for the client's delayed ACK).
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET,
                         socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"residency serve: cannot bind {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    extra = f", {world} ranks" if world > 1 else ""
    if discard is not None:
        extra += f", discard on release: {discard if discard == 'all' else ','.join(discard)}"

    refused: list[str] = []

    async def startup() -> None:
        try:
            await ctl.attach(pipe, checkpoint=checkpoint)
        except (InfeasibleBudget, CheckpointMismatch) as exc:  # bad usage, say why
            refused.append(str(exc))
            raise
        if driver is not None:  # ready when every rank answers, not when this one is
            try:
                await driver.wait_for_ranks(args.collective_timeout)
            except RuntimeError as exc:  # RanksUnavailable: exit 2 naming the rank
                refused.append(str(exc))
                raise
        report = ctl.report()
        print(f"residency serve: http://{args.host}:{port} pipeline {described}, "
              f"{report.device_bytes + report.host_bytes:,} bytes on {ctl.device}, residency "
              f"{ctl.config.to_string() or 'resident'}{extra}; ready", flush=True)

    async def shutdown() -> None:
        if driver is not None:
            await driver.stop()  # every rank detaches with this one
        else:
            await ctl.aclose()

    class Server(uvicorn.Server):
        """uvicorn's server, but a first SIGTERM/SIGINT drains and exits 0 (uvicorn would
        re-raise the signal after its shutdown), and a second one of either exits at once."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True
            # A trainer's broadcast in flight gets the drain, less a second to roll back and
            # answer (JSON) before the server stops waiting for its request.
            ctl.stop_weight_sync(max(0.0, args.drain_timeout - 1.0))

    upload_limit = 1024 * 2**20
    app = create_app(ctl, generate=generate, api_key=args.api_key, on_startup=startup,
                     on_shutdown=shutdown, driver=driver, upload_limit=upload_limit,
                     body_timeout=args.body_timeout, fd_timeout=args.fd_timeout,
                     process_groups=args.api_key is not None or args.allow_process_groups)
    limits = ServerLimits(header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                          max_connections=args.max_connections or None, max_drain=upload_limit)
    config = uvicorn_config(app, limits=limits, log_level="warning", access_log=False,
                            lifespan="on",
                            timeout_graceful_shutdown=max(1, int(args.drain_timeout)))
    try:
        Server(config).run(sockets=[sock])
    except SystemExit:  # uvicorn exits 3 when startup failed
        if not refused:
            raise
    if refused:
        print(f"residency serve: {refused[0]}", file=sys.stderr)
        return 2
    return 0


def _per_rank(spec: str | None, ranks: int) -> int | str | None:
    """A node's budget as one rank's: a size divided by the node's ranks; a percentage or
    ``auto`` as given (the controller splits what it derives)."""
    if spec is None or spec.strip().lower() == "auto" or spec.strip().endswith("%"):
        return spec
    return derive_budgets(spec, ranks=ranks, split_explicit=True).host


def _join_group(args: argparse.Namespace) -> Any:
    """Join the ranks' gloo group (torchrun's or ``--nproc``'s environment variables)."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://",
                            timeout=timedelta(seconds=args.collective_timeout))
    dist.barrier()  # gloo may still be connecting pairs
    return dist.group.WORLD


def _op_store(args: argparse.Namespace, world: int) -> Any:
    """A client of the group's TCPStore, under a prefix of ours (rank 0's ops, answers)."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
        timeout=timedelta(seconds=args.collective_timeout))
    return dist.PrefixStore("residency-serve", store)  # type: ignore[attr-defined]
