"""The turns of a sweep's jobs under hydra/launcher=shared_base (sweep/turns.py): one thread runs at a time, each
until it asks; a round's requests run together, in job order; each job finds its own context at each turn; a job
that fails ends alone."""

from __future__ import annotations

import threading

from grpo_cli.sweep.turns import Turns

PROCESS = {"owner": None}  # stands for what a job sets for the whole process (the RNG, Hydra's config, ...)


class Owner:
    def __init__(self):
        self.owner = PROCESS["owner"]

    def restore(self) -> None:
        PROCESS["owner"] = self.owner


def test_jobs_take_turns_ask_together_and_keep_their_own_context():
    batches, running, most = [], set(), [0]

    def together(requests: list[dict]) -> None:
        batches.append([r["job"] for r in requests])
        for r in requests:
            r["answer"] = r["question"] * 10

    turns = Turns(together, Owner)

    def job(num: int, rounds: int, fails_at: int | None = None):
        def on_turn() -> None:
            running.add(threading.current_thread())
            most[0] = max(most[0], len(running))

        def run():
            on_turn()
            PROCESS["owner"] = num
            answers = []
            try:
                for k in range(rounds):
                    if k == fails_at:
                        raise RuntimeError(f"job {num} failed")
                    request = {"job": num, "question": 100 * num + k}
                    running.discard(threading.current_thread())
                    turns.ask(request)
                    on_turn()
                    assert PROCESS["owner"] == num  # its own, whoever ran in between
                    answers.append(request["answer"])
            finally:
                running.discard(threading.current_thread())
            return answers
        return run

    turns.add(0, job(0, 3))
    turns.add(1, job(1, 3, fails_at=1))
    turns.add(2, job(2, 2))
    PROCESS["owner"] = "sweep"
    jobs = turns.start()
    assert batches == [[0, 1, 2], [0, 2], [0]]  # the failed job left after its first round, the short one after two
    assert [j.result for j in jobs] == [[0, 10, 20], None, [2000, 2010]]
    assert str(jobs[1].error) == "job 1 failed" and jobs[0].error is None and jobs[2].error is None
    assert most[0] == 1  # never two jobs at once
    assert PROCESS["owner"] == "sweep"  # the context the sweep started in, back
