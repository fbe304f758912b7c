"""The RL loop of issue 33 (tests.http.rl_loop) in each client's order, short: two rounds with
the trainer killed in the middle of the second one's broadcast (``python -m tests.http.rl_loop``
runs the 20 rounds of the acceptance, killing the trainer in round 10)."""

from __future__ import annotations

import pytest

from tests.http.rl_loop import CLIENTS, run_loop

pytestmark = [pytest.mark.service, pytest.mark.moves]


@pytest.fixture(autouse=True)
def _quick_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RES_OPTIONS", "timeout:1 attempts:1")  # see tests/ranks/trainer.py


@pytest.mark.parametrize("client", CLIENTS)
def test_each_clients_loop_keeps_the_trainers_weights_and_survives_a_killed_trainer(
        client: str) -> None:
    """Every round ends with the server's checksums equal to the trainer's; the killed round
    is rolled back and done again with a new trainer; no generation is lost."""
    out = run_loop(client, rounds=2, kill_round=2)
    assert (out["rounds"], out["rolled_back"], out["lost"]) == (2, 1, 0), out
    assert out["generations"].get("served", 0) > 0, out
