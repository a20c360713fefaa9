"""`radix-mlx replicas`: N `radix-mlx serve` workers behind SGLang's cache-aware router.

Every worker is a whole server (its own engine and radix tree) on a free 127.0.0.1 port,
the first started alone (it fills the model cache), the rest together once it is ready;
the router (`sglang-router`, a Rust binary from PyPI, the `replicas` extra) is the one
public endpoint. In its cache_aware policy the router keeps an approximate radix tree of
the request text it sent to each worker, so a conversation's next turn goes to the worker
that already holds its prefix, unless the workers' loads drift too far apart
(docs/scale-out.md). This module only starts, watches and stops processes: no routing.

SIGTERM/SIGINT go to every child at once (children have process groups of their own, so
a terminal's Ctrl-C reaches them once, through us, not twice): workers drain (503 to new
requests, in-flight ones finish, /health says so, which the router sees), the router
stops accepting and waits for its in-flight requests. A worker that dies is logged,
routed around (the router's health checks take it out) and restarted on its port after
--restart-delay; the router dying stops the lot.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

import httpx

from server.config import (
    ConfigError,
    Settings,
    add_serve_arguments,
    default_disk_cache_dir,
    load_settings,
)

log = logging.getLogger("radix_mlx.replicas")

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
# What the router writes into a request that names no model: the workers take it as no
# name at all, so such requests work (and are answered) as by one server.
ROUTER_DEFAULT_MODEL = "unknown"
POLL_SECONDS = 0.5
# A worker that dies within this long of its start is crash-looping: its restart delay
# doubles each time, up to the maximum.
CRASH_LOOP_SECONDS = 60.0
MAX_RESTART_DELAY = 60.0


@dataclass
class Child:
    name: str
    url: str
    process: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    restart_at: float | None = None
    restart_delay: float = 0.0

    def exited(self) -> int | None:
        return self.process.poll()

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


def add_replicas_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="how many servers to start")
    parser.add_argument("--model", help=Settings.model_fields["model"].description)
    parser.add_argument("--host", default="127.0.0.1", help="the router's address")
    parser.add_argument("--port", type=int, default=8000, help="the router's port")
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware",
                        help="the router's policy (round_robin: to compare against)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="the router's Prometheus port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--health-check-interval", type=int, default=2, metavar="SECONDS",
                        help="how often the router probes each worker's /health")
    parser.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="how long workers may take to load and warm up")
    parser.add_argument("--restart-delay", type=float, default=2.0, metavar="SECONDS",
                        help="a worker that exits is restarted after this long, doubling "
                             "while it keeps dying within a minute (0: never restart)")
    parser.add_argument("--drain-timeout", type=float, default=15.0, metavar="SECONDS",
                        help="on SIGTERM, how long in-flight requests get to finish")
    parser.add_argument("--cuda-devices", type=lambda text: text.split(","), default=[],
                        metavar="LIST",
                        help="comma-separated CUDA devices: worker i sees only the (i mod "
                             "count)th, so each has a GPU of its own (default: all see all)")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, metavar="-- SERVE_FLAGS",
                        help="flags for every worker's `radix-mlx serve` after `--`, "
                             "e.g. -- --cache-bytes 8000000000")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serve_flags(args: argparse.Namespace) -> list[str]:
    return [arg for arg in args.serve_args if arg != "--"]


def worker_command(args: argparse.Namespace, settings: Settings, index: int,
                   port: int) -> list[str]:
    """Worker `index`'s `radix-mlx serve`. Each keeps its disk tier in a directory of its
    own (`worker-<index>` under the configured one), so no worker evicts another's files,
    and a restarted set finds its own again; each plans for its share of the memory."""
    model = ["--model", args.model] if args.model else []
    disk = (settings.disk_cache_dir or default_disk_cache_dir()) / f"worker-{index}"
    share = worker_memory_share(args, settings, index)
    memory = ["--memory-share", repr(share)] if share is not None else []
    return [sys.executable, "-m", "server", *model, "--host", "127.0.0.1", "--port", str(port),
            "--drain-timeout", str(args.drain_timeout),
            "--unnamed-model-alias", ROUTER_DEFAULT_MODEL, *serve_flags(args), *memory,
            "--disk-cache-dir", str(disk)]


def worker_memory_share(args: argparse.Namespace, settings: Settings, index: int
                        ) -> float | None:
    """Worker `index`'s share of its device's memory: 1/k where k workers share that
    device (every worker on this machine, or those given the same --cuda-devices entry);
    None where it has a device to itself or the settings fix its memory already."""
    if settings.model_fields_set & {"memory_limit_bytes", "memory_share"}:
        return None
    devices = [worker_device(args, i) for i in range(args.workers)]
    sharing = devices.count(devices[index])
    return 1 / sharing if sharing > 1 else None


def worker_device(args: argparse.Namespace, index: int) -> str | None:
    """The CUDA device worker `index` alone sees, or None: all of them."""
    if not args.cuda_devices:
        return None
    return args.cuda_devices[index % len(args.cuda_devices)]


def worker_env(args: argparse.Namespace, index: int) -> dict[str, str]:
    """Ours, with worker `index`'s GPU when --cuda-devices names them."""
    env = dict(os.environ)
    device = worker_device(args, index)
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    return env


def worker_settings(args: argparse.Namespace) -> Settings:
    """What every worker will run with (its flags, the environment, the config file):
    read here too, so a bad flag fails before anything starts, and the router gets the
    workers' API key."""
    parser = argparse.ArgumentParser(prog="radix-mlx replicas ... --")
    add_serve_arguments(parser)
    return load_settings(parser.parse_args(serve_flags(args)))


def router_command(
    args: argparse.Namespace, worker_urls: list[str], api_key: str | None = None
) -> list[str]:
    """sglang-router's own launcher. With the workers' API key, the router requires it
    from clients too and sends it on to the workers. Its Prometheus exporter gets a port
    of its own (its default is fixed, so two routers on one host would collide); its
    shutdown grace matches ours."""
    key = ["--api-key", api_key] if api_key else []
    return [
        sys.executable, "-m", "sglang_router.launch_router",
        "--host", args.host, "--port", str(args.port),
        "--worker-urls", *worker_urls,
        "--policy", args.policy,
        # Two missed probes in a row take a worker out; two good ones bring it back.
        "--health-check-interval-secs", str(args.health_check_interval),
        "--health-failure-threshold", "2",
        "--health-check-endpoint", "/health",
        "--shutdown-grace-period-secs", str(int(args.drain_timeout) + 5),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(args.metrics_port),
        "--log-level", "warn", *key,
    ]


def router_installed() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


class Supervisor:
    def __init__(self, args: argparse.Namespace, settings: Settings) -> None:
        self.args = args
        self.settings = settings
        self.api_key = settings.api_key.get_secret_value() if settings.api_key else None
        self.workers: list[Child] = []
        self.router: Child | None = None
        self.stopping = False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self._start_workers()
            if not self.stopping:
                self._start_router()
            if not self.stopping:
                return self._watch()
            return 0
        except StartupError as error:
            log.error("%s", error)
            return 1
        finally:
            self._stop()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:  # a second signal: no more waiting
            for child in self._children():
                child.process.kill()
        self.stopping = True

    def _children(self) -> list[Child]:
        return [*self.workers, *([self.router] if self.router else [])]

    def _start_workers(self) -> None:
        # The first worker alone first: it downloads or converts the model into the cache
        # once, where the others then find it (N at once would each do it, racing).
        deadline = time.monotonic() + self.args.startup_timeout
        self._start_worker(0)
        self._wait_until(deadline, self.workers[0],
                         lambda: _healthy(self.workers[0].url + "/health"))
        if self.stopping:
            return
        for index in range(1, self.args.workers):
            self._start_worker(index)
        for worker in self.workers[1:]:
            self._wait_until(deadline, worker, lambda w=worker: _healthy(w.url + "/health"))

    def _start_worker(self, index: int) -> None:
        port = free_port()
        process = self._spawn(index, port)
        self.workers.append(Child(f"worker {index}", f"http://127.0.0.1:{port}", process))
        log.info("worker %d: pid %d, %s", index, process.pid, self.workers[-1].url)

    def _spawn(self, index: int, port: int) -> subprocess.Popen:
        return subprocess.Popen(worker_command(self.args, self.settings, index, port),
                                env=worker_env(self.args, index), process_group=0)

    def _look_after(self, worker: Child) -> None:
        """Restart a worker that exited, on its own port (the router knows it by its URL):
        the router's probes take it out meanwhile and bring it back once it is ready."""
        now = time.monotonic()
        if worker.restart_at is None and worker.exited() is not None:
            young = now - worker.started < CRASH_LOOP_SECONDS
            worker.restart_delay = (min(2 * worker.restart_delay, MAX_RESTART_DELAY)
                                    if young and worker.restart_delay
                                    else self.args.restart_delay)
            worker.restart_at = now + worker.restart_delay
            log.warning("%s (%s) exited with status %s; the router routes around it%s",
                        worker.name, worker.url, worker.exited(),
                        f"; restarting it in {worker.restart_delay:.0f} s"
                        if self.args.restart_delay else "")
        elif self.args.restart_delay and worker.restart_at and now >= worker.restart_at:
            worker.process = self._spawn(self.workers.index(worker), worker.port)
            worker.started, worker.restart_at = now, None
            log.info("%s: pid %d, %s (restarted)", worker.name, worker.process.pid,
                     worker.url)

    def _start_router(self) -> None:
        url = f"http://{self.args.host}:{self.args.port}"
        self.args.metrics_port = self.args.metrics_port or free_port()
        process = subprocess.Popen(
            router_command(self.args, [w.url for w in self.workers], self.api_key),
            process_group=0)
        self.router = Child("router", url, process)
        deadline = time.monotonic() + 60.0
        self._wait_until(deadline, self.router,
                         lambda: router_ready(url, len(self.workers), self.api_key))
        log.info("ready: %s routes to %d workers (%s policy); router metrics on "
                 "http://127.0.0.1:%d/metrics", url, len(self.workers), self.args.policy,
                 self.args.metrics_port)

    def _wait_until(self, deadline: float, child: Child, ready: Callable[[], bool]) -> None:
        while not self.stopping and not ready():
            if child.exited() is not None:
                raise StartupError(f"{child.name} exited with status {child.exited()}")
            if time.monotonic() > deadline:
                raise StartupError(f"{child.name} not ready in time ({child.url})")
            time.sleep(POLL_SECONDS)

    def _watch(self) -> int:
        while not self.stopping:
            time.sleep(POLL_SECONDS)
            if self.router.exited() is not None:
                log.error("the router exited with status %s", self.router.exited())
                return 1
            for worker in self.workers:
                self._look_after(worker)
            if not self.args.restart_delay and all(w.exited() is not None
                                                   for w in self.workers):
                log.error("every worker has exited")
                return 1
        return 0

    def _stop(self) -> None:
        """SIGTERM to every child still running, then wait for the drain; SIGKILL after."""
        children = [child for child in self._children() if child.exited() is None]
        for child in children:
            child.process.terminate()
        deadline = time.monotonic() + self.args.drain_timeout + 10.0
        for child in children:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", child.name)
                child.process.kill()
                child.process.wait()


class StartupError(RuntimeError):
    pass


def _get(url: str, api_key: str | None = None) -> httpx.Response | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        return httpx.get(url, headers=headers, timeout=5.0)
    except httpx.HTTPError:
        return None


def _healthy(url: str) -> bool:
    response = _get(url)
    if response is None:
        return False
    if response.status_code == 503 and response.json().get("status") == "failed":
        raise StartupError(f"the model failed to load: {response.json().get('error')}")
    return response.status_code == 200


def router_ready(url: str, workers: int, api_key: str | None = None) -> bool:
    """The router has registered every worker, healthy, under its served model name."""
    response = _get(url + "/workers", api_key)
    if response is None or response.status_code != 200:
        return False
    listed = response.json().get("workers", [])
    return len(listed) == workers and all(
        w.get("is_healthy") and w.get("model_id") != ROUTER_DEFAULT_MODEL for w in listed)


def replicas_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per readiness poll
    if args.workers < 1:
        print("radix-mlx replicas: --workers must be at least 1", file=sys.stderr)
        return 2
    if not router_installed():
        print("radix-mlx replicas: the router is not installed; "
              "run `pip install 'radix-mlx[replicas]'` (or `make replicas`)", file=sys.stderr)
        return 2
    try:
        settings = worker_settings(args)
    except ConfigError as error:
        print(f"radix-mlx replicas: {error}", file=sys.stderr)
        return 2
    return Supervisor(args, settings).run()
