"""The ``--cpu`` weight-sync group (:class:`StatelessGlooGroup`): a peer that never comes ends the wait within
``OPENRLHF_LOPTI_CPU_SYNC_TIMEOUT`` seconds with an error naming it, instead of gloo's 30 minutes.

Two ranks of a real gloo group in threads of this process (gloo's TCP transport, as between a policy rank and a vLLM
worker); the waits are bounded by the test too, so a regression fails here in seconds rather than hanging the suite.
What this cannot show: that Ray then ends the run (tests/test_openrlhf_cpu_pipeline.py plants an error at a real
sync and times the run's end) or that a vLLM worker refusing a weight still completes the broadcast
(tests/test_openrlhf_cpu_vllm.py).
"""

import threading
import time

import pytest
import torch

from openrlhf_lopti.openrlhf.cpu.sync import SYNC_TIMEOUT_ENV, StatelessGlooGroup, sync_timeout

from .ds_ranks import free_port

TIMEOUT_S = 3
# A group that must form first waits this long instead (its connect is bounded by the same timeout): 3 s was
# crossed once with make test's two tracks beside each other (load 5-6: "client socket has timed out after 3000ms").
FORMING_TIMEOUT_S = 20
# The test's own limit on each wait (gloo's old default was 30 minutes), and how late after the group's timeout a
# wait may end: a minute, so that threads starved by busy processes still end well inside it.
BOUND_S = 180
LATE_S = 60


def start(fn, *args) -> tuple:
    """``fn(*args)`` in a daemon thread; :func:`finish` waits for it."""
    out = {}

    def body():
        begin = time.monotonic()
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc
        out["seconds"] = time.monotonic() - begin

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


def finish(started: tuple) -> dict:
    """Wait at most BOUND_S for a :func:`start` ed call; ``{"value" | "error", "seconds", "finished"}``."""
    thread, out = started
    thread.join(BOUND_S)
    return {**out, "finished": not thread.is_alive()}


def in_thread(fn, *args) -> dict:
    return finish(start(fn, *args))


def pair(port: int) -> tuple:
    """Rank 0 (the policy's) and rank 1 (a vLLM worker's) of one group."""
    ranks = [finish(call) for call in [start(StatelessGlooGroup, "127.0.0.1", port, rank, 2) for rank in (0, 1)]]
    assert all(r["finished"] and "value" in r for r in ranks), ranks
    return ranks[0]["value"], ranks[1]["value"]


def test_the_timeout_is_a_minute_unless_set(monkeypatch):
    monkeypatch.delenv(SYNC_TIMEOUT_ENV, raising=False)
    assert sync_timeout().total_seconds() == 60
    monkeypatch.setenv(SYNC_TIMEOUT_ENV, "2.5")
    assert sync_timeout().total_seconds() == 2.5
    for bad in ("0", "-1", "x", "inf", "nan"):
        monkeypatch.setenv(SYNC_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=f"{SYNC_TIMEOUT_ENV}='{bad}': must be a number of seconds > 0"):
            sync_timeout()


def test_a_broadcast_whose_peer_never_enters_it_fails_within_the_timeout(monkeypatch):
    monkeypatch.setenv(SYNC_TIMEOUT_ENV, str(FORMING_TIMEOUT_S))
    policy, engine = pair(free_port())
    ok = torch.arange(6.0)
    received = torch.zeros(6)
    both = [finish(call) for call in [start(policy.broadcast, ok, 0), start(engine.broadcast, received, 0)]]
    assert all(r["finished"] and "error" not in r for r in both) and torch.equal(received, ok)  # the group works

    alone = in_thread(policy.broadcast, torch.ones(2, 3), 0)  # the engine failed before its broadcast
    assert alone["finished"], f"the policy's broadcast still waits after {BOUND_S} s (gloo's default: 30 minutes)"
    message = str(alone["error"])
    assert isinstance(alone["error"], RuntimeError)
    assert FORMING_TIMEOUT_S - 1 < alone["seconds"] < FORMING_TIMEOUT_S + LATE_S
    assert message.startswith("--cpu weight sync: rank 0's broadcast of a (2, 3) torch.float32 tensor from rank 0 ")
    waited = f"did not come within {FORMING_TIMEOUT_S} s, {SYNC_TIMEOUT_ENV}): "
    assert f"did not complete (a peer failed, left, or {waited}" in message


def test_a_group_whose_peer_never_joins_fails_within_the_timeout(monkeypatch):
    monkeypatch.setenv(SYNC_TIMEOUT_ENV, str(TIMEOUT_S))
    port = free_port()
    alone = in_thread(StatelessGlooGroup, "127.0.0.1", port, 0, 2)  # an engine that never joined
    assert alone["finished"], f"rank 0 still waits for its peer after {BOUND_S} s"
    assert isinstance(alone["error"], RuntimeError) and alone["seconds"] < LATE_S
    assert str(alone["error"]).startswith(f"--cpu weight sync: rank 0 of 2 could not form the gloo group at 127.0.0.1:{port} within {TIMEOUT_S} s, {SYNC_TIMEOUT_ENV}: ")


def _join_receive_then_exit(port: int) -> None:
    import os

    # The group is held until the process dies: a group dropped at once closes its sockets while rank 0 may still
    # be in its half of the handshake (CI twice: "Connection closed by peer" from rank 0's forming), and would test a
    # closed group rather than a dead process.
    group = StatelessGlooGroup("127.0.0.1", port, 1, 2)
    received = torch.zeros(3)
    group.broadcast(received, 0)  # the group works on both sides before this engine dies
    os._exit(1 if torch.equal(received, torch.arange(3.0)) else 2)  # an engine process that dies after a sync


def test_a_broadcast_whose_peer_process_died_fails_at_once(monkeypatch):
    import multiprocessing

    monkeypatch.setenv(SYNC_TIMEOUT_ENV, "600")  # far above the bound below: an error before it is not the timeout
    port = free_port()
    peer = multiprocessing.get_context("spawn").Process(target=_join_receive_then_exit, args=(port,))
    peer.start()
    policy = StatelessGlooGroup("127.0.0.1", port, 0, 2)
    policy.broadcast(torch.arange(3.0), 0)
    peer.join(BOUND_S)
    assert peer.exitcode == 1, f"the peer's exit code {peer.exitcode} (1: it received the first broadcast and died)"
    alone = in_thread(policy.broadcast, torch.ones(3), 0)
    # gloo sees the closed connection, no timeout needed (under a second; 60 s allows for busy processes)
    assert alone["finished"] and alone["seconds"] < 60, alone
    assert "did not complete" in str(alone["error"]) and "Connection closed by peer" in str(alone["error"])
