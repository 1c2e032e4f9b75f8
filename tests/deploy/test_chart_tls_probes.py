"""The chart's probes over TLS, run for real: the exec probe commands and the ``helm test`` command
rendered with ``tls.enabled`` (and ``tls.mutual``) run as processes against a real router that
serves mutual TLS (real Redis, gRPC on loopback). The mounted Secret is a folder with ``tls.crt``,
``tls.key`` and ``ca.crt``, generated here (tests.support_tls) for the router Service's name only,
which the probes check the certificate against while they dial 127.0.0.1. Right CA: exit 0; another
CA, or no client certificate where mTLS is required: exit 1 with the reason."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvroute.tls import channel_credentials
from kvroute_tools.health import check_service
from kvroute_tools.redis_server import RedisServer
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.deploy.chart import FULLNAME, container, find, render
from tests.deploy.local_pods import program
from tests.support import wait_for
from tests.support_tls import TestCA

ROUTER = f"{FULLNAME}-router"
TLS_DIR = "/etc/kvroute/tls"
CHECKOUT = Path(__file__).resolve().parents[2]


def _secret(folder: Path, ca: TestCA, cert: tuple[str, str]) -> Path:
    """A folder laid out like the mounted kubernetes.io/tls Secret."""
    folder.mkdir()
    shutil.copy(ca.file, folder / "ca.crt")
    shutil.copy(cert[0], folder / "tls.crt")
    shutil.copy(cert[1], folder / "tls.key")
    return folder


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("tls")
    ca, other = TestCA(root, "kvroute-ca"), TestCA(root, "other-ca")
    cert = ca.issue("kvroute", dns_names=(ROUTER,), loopback=False)  # 127.0.0.1 only works through the name
    return {"cert": cert, "ca": str(ca.file), "secret": _secret(root / "secret", ca, cert),
            "wrong_ca": _secret(root / "wrong-ca", other, cert)}


@pytest.fixture(scope="module")
def router(pki, default_model_dir):
    cert, key = pki["cert"]
    with RedisServer() as redis:
        settings = RouterSettings(host="127.0.0.1", port=0, redis_url=redis.url, namespace="tls-probes",
                                  model=str(default_model_dir), heartbeat_poll_interval=0.1,
                                  tls_cert_file=cert, tls_key_file=key, tls_client_ca_file=pki["ca"])
        with BackgroundRouter(settings) as r:
            creds = channel_credentials(pki["ca"], cert, key)
            wait_for(lambda: check_service(r.target, "readiness", 2, credentials=creds, server_name=ROUTER).ok,
                     30, what="router readiness over TLS")
            yield r


def _run(command: list[str], secret: Path, target: str) -> subprocess.CompletedProcess:
    """A rendered command as the pod would run it: the Secret's mount path is ``secret``, and the
    ``--target`` is the test's router."""
    argv = [a.replace(TLS_DIR, str(secret)) for a in command]
    argv[argv.index("--target") + 1] = target
    return subprocess.run(program(argv), capture_output=True, text=True, timeout=60, cwd=CHECKOUT,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(CHECKOUT), "HOME": str(secret.parent)})


def _router_probe(values: dict, kind: str) -> list[str]:
    return container(find(render(values), "Deployment", ROUTER), "router")[kind]["exec"]["command"]


MUTUAL = {"tls": {"enabled": True, "existingSecret": "kvr-tls", "mutual": True}}


@pytest.mark.parametrize("kind", ["readinessProbe", "livenessProbe"])
def test_the_rendered_probe_passes_with_the_right_ca_and_fails_with_another(router, pki, kind):
    command = _router_probe(MUTUAL, kind)
    ok = _run(command, pki["secret"], router.target)
    service = "readiness" if kind == "readinessProbe" else "liveness"
    assert (ok.returncode, ok.stdout.strip()) == (0, f"{router.target}: {service} is SERVING"), ok.stderr
    wrong = _run(command, pki["wrong_ca"], router.target)
    assert wrong.returncode == 1 and wrong.stdout == ""
    assert f"{router.target}: health check {service!r} failed: UNAVAILABLE" in wrong.stderr


def test_the_probe_without_a_client_certificate_fails_where_mtls_is_required(router, pki):
    command = _router_probe({"tls": {"enabled": True, "existingSecret": "kvr-tls"}}, "readinessProbe")
    assert "--tls-cert-file" not in command
    done = _run(command, pki["secret"], router.target)
    assert done.returncode == 1 and "health check 'readiness' failed: UNAVAILABLE" in done.stderr


def test_the_helm_test_command_speaks_tls_to_the_router(router, pki):
    command = find(render(MUTUAL), "Pod", f"{FULLNAME}-test-health")["spec"]["containers"][0]["command"]
    done = _run(command, pki["secret"], router.target)
    # Through TLS to the router's answer: ready, but this router has no replica to route to.
    assert done.returncode == 1
    assert done.stderr.strip() == (f"router at {router.target}: SERVING but no replica is known (none heartbeating"
                                   " in its Redis namespace)")


def test_without_the_server_name_the_certificate_does_not_match_127_0_0_1(router, pki):
    command = _router_probe(MUTUAL, "readinessProbe")
    at = command.index("--tls-server-name")
    done = _run(command[:at] + command[at + 2:], pki["secret"], router.target)
    assert done.returncode == 1 and "health check 'readiness' failed: UNAVAILABLE" in done.stderr


def test_a_server_name_without_a_ca_is_a_usage_error(capsys):
    from kvroute_tools.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["health", "--service", "readiness", "--tls-server-name", ROUTER])
    assert exit_.value.code == 2 and "--tls-server-name: needs --tls-ca-file" in capsys.readouterr().err


def _notes_generate(values: dict) -> list[str]:
    """The ``kvroute generate`` command the NOTES print, split as a shell would."""
    import shlex

    from tests.deploy.chart import notes

    line = next(line for line in notes(values).splitlines() if line.startswith("  kvroute generate "))
    return shlex.split(line)


def test_the_notes_generate_command_speaks_mutual_tls_to_the_router_by_its_service_name(router, pki):
    command = _notes_generate(MUTUAL)
    assert command[command.index("--tls-server-name") + 1] == ROUTER
    # The files the NOTES have the user take from the Secret, in the current folder.
    argv = [str(pki["secret"] / a) if a in ("ca.crt", "tls.crt", "tls.key") else a for a in command]
    argv[argv.index("--target") + 1] = router.target
    done = _run(argv + ["--max-tokens", "1"], pki["secret"], router.target)
    # Through TLS to the router's answer: it has no replica to send the request to.
    assert done.returncode == 1
    assert f"UNAVAILABLE: the router at {router.target} has no replica to send the request to" in done.stderr
    at = argv.index("--tls-server-name")
    wrong_name = _run(argv[:at] + argv[at + 2:] + ["--max-tokens", "1"], pki["secret"], router.target)
    assert wrong_name.returncode == 1  # 127.0.0.1 is not in the certificate: no handshake
    assert f"UNAVAILABLE: cannot reach a router at {router.target}" in wrong_name.stderr


def test_a_server_name_without_a_ca_is_a_usage_error_of_generate_too(capsys):
    from kvroute_tools.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--tls-server-name", ROUTER, "hello"])
    assert exit_.value.code == 2 and "--tls-server-name: needs --tls-ca-file" in capsys.readouterr().err
