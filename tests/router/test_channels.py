"""router.channels: one channel per replica address, pruned only when idle and unadvertised."""

from __future__ import annotations

import asyncio

from router.channels import ReplicaChannels


def test_one_channel_per_address_and_only_idle_unadvertised_ones_are_pruned():
    async def run() -> None:
        channels = ReplicaChannels(idle_s=0.0)
        assert channels.stub("127.0.0.1:1") is channels.stub("127.0.0.1:1")
        channels.stub("127.0.0.1:2")
        with channels.in_flight("127.0.0.1:3"):
            assert channels.prune(keep={"127.0.0.1:2"}) == 1  # :1 goes; :2 is advertised, :3 busy
            assert len(channels) == 2
        assert channels.prune(keep=set()) == 2 and len(channels) == 0
        await channels.close()

    asyncio.run(run())
