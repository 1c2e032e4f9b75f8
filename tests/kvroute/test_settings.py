"""kvroute.settings: flags over KVROUTE_* variables over defaults; secrets stay out of reprs."""

from __future__ import annotations

from kvroute.settings import load_settings
from router.settings import RouterSettings


def test_the_redis_password_comes_from_the_environment_and_never_shows_in_the_repr():
    s = load_settings(RouterSettings, [], env={"KVROUTE_REDIS_PASSWORD": "hunter2", "KVROUTE_PORT": "7000"})
    assert (s.redis_password, s.port) == ("hunter2", 7000)
    assert "hunter2" not in repr(s) and "redis_password" not in repr(s)
    assert load_settings(RouterSettings, ["--port", "7001"], env={"KVROUTE_PORT": "7000"}).port == 7001
