"""``kvroute up``'s command: start the cluster (kvroute_tools.cluster), print the banner, then wait
for Ctrl-C / SIGTERM, a child's death, or the end of the command given after ``--``, and stop.

    up_main ─▶ LocalCluster.start ─▶ banner ─▶ [CMD with {target} / {targets} / {http_url} filled in] ─▶ wait ─▶ stop

SIGTERM and SIGINT become an exception in the main thread while it waits; the stop that follows is
one orderly stop that a second signal cannot cut short.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from kvroute.counted import counted
from kvroute_tools.banner import banner_text
from kvroute_tools.cluster import ClusterConfig, ClusterError, LocalCluster
from kvroute_tools.supervise import pdeathsig_preexec


class _Terminated(BaseException):
    """SIGTERM, turned into an exception in the main thread (like KeyboardInterrupt for SIGINT)."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated()


def substitute(command: Sequence[str], cluster: LocalCluster) -> list[str]:
    """The command with ``{target}`` (the front's host:port: Envoy's listener with ``--gateway envoy``,
    else the first router's), ``{targets}`` (every router's host:port, comma-separated, the first
    first; the front alone with ``--gateway envoy``), ``{http_url}`` (the first router's
    OpenAI-compatible HTTP API, ``http://host:port/v1``), ``{redis_url}`` and ``{admin_token_file}``
    (the file holding the routers' admin token, for SetPolicy) filled in."""
    targets = cluster.front_target if cluster.envoy is not None else ",".join(cluster.router_targets)
    return [a.replace("{targets}", targets).replace("{target}", cluster.front_target)
            .replace("{http_url}", cluster.router_http_url).replace("{redis_url}", cluster.redis_url)
            .replace("{admin_token_file}", str(cluster.admin_token_file))
            for a in command]


def up_main(config: ClusterConfig, command: Sequence[str] = (), *, out=None) -> int:
    """``kvroute up``: start, print the banner, then wait for Ctrl-C / SIGTERM (exit 0) or a child's
    death (exit 1; with ``config.keep_going`` a replica's death is logged and the others serve on,
    until none is left or another process dies); with ``command``, run it once ready (``{target}`` filled in), stop, and exit with
    its status (130 when Ctrl-C / SIGTERM cut it short). Exit 1 when the cluster cannot start, with
    the reason."""
    out = out or sys.stdout

    def log(*a: object, flush: bool = False) -> None:
        print(*a, file=out, flush=flush)

    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    # A job started in the background by a script inherits SIGINT ignored, and Python then installs
    # no Ctrl-C handler: take SIGINT explicitly so `kill -INT` stops the cluster there too.
    previous_int_handler = signal.signal(signal.SIGINT, _raise_terminated)
    cluster = LocalCluster(config, log=log)
    cmd_proc: subprocess.Popen | None = None
    lost: set[str] = set()  # with --keep-going: the replicas' processes that died
    rc = 0
    started = False
    t0 = time.monotonic()
    try:
        try:
            cluster.start()
        except ClusterError as e:
            print(f"kvroute up: {e}", file=sys.stderr, flush=True)
            return 1
        started = True
        log(banner_text(cluster), flush=True)
        log(f"kvroute up: ready in {time.monotonic() - t0:.1f} s"
            + ("" if command else "; Ctrl-C (or SIGTERM) stops everything"), flush=True)
        if command:
            argv = substitute(command, cluster)
            log(f"kvroute up: running {shlex.join(argv)}", flush=True)
            cmd_proc = subprocess.Popen(argv, preexec_fn=pdeathsig_preexec())
        while True:
            if cmd_proc is not None and cmd_proc.poll() is not None:
                rc = exit_status(cmd_proc.returncode)
                if cmd_proc.returncode < 0:
                    log(f"kvroute up: the command was killed by {signal.Signals(-cmd_proc.returncode).name}",
                        flush=True)
                break
            dead = cluster.first_death(ignore=lost)
            if dead is not None:
                if config.keep_going and cluster.is_replica(dead) and cluster.serving_replicas() > 0:
                    lost.add(dead.name)
                    left = counted(cluster.serving_replicas(), "replica")
                    print(f"kvroute up: {cluster.describe_death(dead)}\nkvroute up: serving on with {left}"
                          " (--keep-going)", file=sys.stderr, flush=True)
                    continue
                print(f"kvroute up: {cluster.describe_death(dead)}\nkvroute up: stopping the cluster",
                      file=sys.stderr, flush=True)
                rc = 1
                break
            time.sleep(0.5)
    except (KeyboardInterrupt, _Terminated):
        log("\nkvroute up: stopping ...", flush=True)
        if cmd_proc is not None:
            rc = 130  # the command was cut short
    finally:
        # One orderly stop (bounded by stop_timeout + a few seconds): a second Ctrl-C or SIGTERM
        # must not cut it short and leave processes behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        t_stop = time.monotonic()
        if cmd_proc is not None and cmd_proc.poll() is None:
            cmd_proc.terminate()
            try:
                cmd_proc.wait(config.stop_timeout)
            except subprocess.TimeoutExpired:
                cmd_proc.kill()
                cmd_proc.wait()
        cluster.stop()
        if started:
            log(f"kvroute up: stopped {len(cluster.children)} processes in {time.monotonic() - t_stop:.1f} s",
                flush=True)
        signal.signal(signal.SIGINT, previous_int_handler)
        signal.signal(signal.SIGTERM, previous)
    return rc


def exit_status(returncode: int) -> int:
    """The shell's exit status for a child's ``subprocess`` return code.

    A child killed by signal N has return code -N; a shell reports it as 128 + N (POSIX sh, "Exit
    Status"), and so does ``kvroute up`` (``sys.exit(-6)`` would read as 250).
    """
    return 128 - returncode if returncode < 0 else returncode


__all__ = ["exit_status", "substitute", "up_main"]
