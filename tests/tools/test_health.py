"""``kvroute health --target HOST:PORT`` against a real router (real Redis, gRPC on loopback): exit 0
only when readiness is SERVING and a replica is routable; otherwise exit 1 with one line that says
why. The replicas are engine-less (tests.support_redis.FakeReplica: a real publisher's heartbeats)."""

from __future__ import annotations

import pytest

from kvroute_tools.cli import main
from kvroute_tools.redis_server import free_port
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.support import wait_for
from tests.support_redis import fake_replicas  # noqa: F401 - fixture
from tests.support_redis import redis_layout as layout  # noqa: F401 - fixture
from tests.support_redis import redis_server as server  # noqa: F401 - fixture


def _health(capsys, target: str) -> tuple[int, str, str]:
    code = main(["health", "--target", target, "--timeout", "2"])
    out = capsys.readouterr()
    return code, out.out.strip(), out.err.strip()


def _router(server, model_dir, **kw) -> BackgroundRouter:  # noqa: F811 - the fixture's value
    base = dict(host="127.0.0.1", port=0, redis_url=server.url, namespace="test", model=str(model_dir), seed=0,
                heartbeat_poll_interval=0.1, load_sync_interval=0.1)
    return BackgroundRouter(RouterSettings(**{**base, **kw}))


def test_no_router_at_the_target_is_one_line_and_exit_1(capsys):
    code, out, err = _health(capsys, f"127.0.0.1:{free_port()}")
    assert code == 1 and out == ""
    assert err.startswith("router at 127.0.0.1:") and "health check failed: UNAVAILABLE" in err
    assert "\n" not in err


def test_a_router_that_has_not_read_redis_yet_is_not_ready(capsys, default_model_dir):
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    settings = RouterSettings(host="127.0.0.1", port=0, redis_url=dead_redis, model=str(default_model_dir))
    with BackgroundRouter(settings, ready_timeout=None) as r:
        code, _, err = _health(capsys, r.target)
    assert code == 1
    assert err == f"router at {r.target}: readiness is NOT_SERVING (still reading the event streams from Redis," \
                  " or shutting down)"


def test_a_ready_router_without_replicas_fails(capsys, server, default_model_dir):  # noqa: F811
    with _router(server, default_model_dir) as r:
        code, _, err = _health(capsys, r.target)
    assert code == 1 and "SERVING but no replica is known" in err


def test_only_hash_incompatible_replicas_fail_with_each_ones_reason(capsys, server, default_model_dir,  # noqa: F811
                                                                    fake_replicas):  # noqa: F811
    fake_replicas("odd-0", identity={"block_size": 32})
    with _router(server, default_model_dir) as r:
        wait_for(lambda: r.server.registry.get("odd-0") is not None, what="the heartbeat")
        code, _, err = _health(capsys, r.target)
    assert code == 1
    assert err.startswith(f"router at {r.target}: SERVING but no replica is routable: odd-0 (127.0.0.1:50051): ")
    assert "block_size" in err


def test_a_routable_replica_makes_it_healthy(capsys, server, default_model_dir, fake_replicas):  # noqa: F811
    fake_replicas("ok-0")
    fake_replicas("odd-1", identity={"block_size": 32})
    with _router(server, default_model_dir) as r:
        wait_for(lambda: r.server.registry.routable(), what="ok-0 routable")
        code, out, err = _health(capsys, r.target)
    assert (code, err) == (0, "")
    assert out == f"router at {r.target}: SERVING, 1 routable replica: ok-0"


@pytest.mark.parametrize(("argv", "message"), [
    (["health", "--target", "nohost"], "--target: expected HOST:PORT"),
    (["health", "--timeout", "0"], "--timeout: must be > 0"),
])
def test_bad_arguments_exit_2_naming_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
