"""The control plane's typed answers (coordinator/contract/answers.py): what the server
renders with `as_json` reads back the same with `read_answer`; a client leaves out what
another participant adds and refuses, naming the call, what does not fit."""

from __future__ import annotations

import pytest

from gym_proxy.coordinator.contract.answers import (
    NOT_OPEN,
    AnswerError,
    OperationReport,
    OperationsStatus,
    PrepareAnswer,
    ReadinessReport,
    RenewAnswer,
    ServerStatus,
    SlotOutcome,
    WorkerStatus,
    read_answer,
)

pytestmark = pytest.mark.fast


def report(*, complete: bool | None = None) -> OperationReport:
    return OperationReport(
        operation="drain", reason="operator", started_at=1.0, step="done", detail="",
        step_slot=None, moved=2, failed=[], episodes_moved=0, episodes_failed=[],
        episodes_handed_over=[], slots=[SlotOutcome(0, owner="o0", draining=True)], errors=[],
        seconds=0.5, waiting=0, complete=complete,
    )  # fmt: skip


def test_an_answer_reads_back_as_it_was_rendered():
    status = ServerStatus(
        kind="resources", instance="apps", phase="idle", checkpoint_id=None,
        lease_expires_at=None, report=NOT_OPEN, retired_rollouts=0,
        workers=[WorkerStatus(0, "o0", 11, 0, None, state="ready")],
        operations=OperationsStatus(None, report(complete=True)),
    )  # fmt: skip
    assert read_answer(ServerStatus, status.as_json(), "status") == status


def test_what_another_participant_adds_is_left_out_at_every_level():
    wire = {
        "phase": "prepared",
        "staging_keys": ["k"],  # the model participant's own
        "report": {**NOT_OPEN.as_json(), "ready": True, "sampled_at": 3},
    }
    answer = read_answer(PrepareAnswer, wire, "prepare")
    assert answer == PrepareAnswer("prepared", ReadinessReport(True, [], 0, {}, []))


@pytest.mark.parametrize(
    ("wire", "says"),
    [
        ([], "prepare answered list, not a JSON object"),
        ({"phase": "prepared"}, "missing key(s) report"),
        ({"phase": "done", "report": NOT_OPEN.as_json()}, "phase is not"),
        ({"phase": "prepared", "report": {"ready": "yes"}}, "ReadinessReport"),
    ],
)
def test_an_answer_that_does_not_fit_is_refused_naming_the_call(wire, says):
    with pytest.raises(AnswerError, match="prepare") as refused:
        read_answer(PrepareAnswer, wire, "prepare")
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_slot_says_only_what_happened_to_it_and_a_report_its_end_once_ended():
    assert SlotOutcome(3, removed=True, outcome="stopped").as_json() == {
        "slot": 3,
        "removed": True,
        "outcome": "stopped",
    }
    running = report().as_json()
    assert "complete" not in running and "workers" not in running
    assert running["step_slot"] is None  # not an ending field: said as null
    assert report(complete=False).as_json()["complete"] is False


def test_nemo_gyms_renew_answers_the_lease_alone():
    assert read_answer(RenewAnswer, {"lease_expires_at": 5.0}, "renew") == RenewAnswer(5.0)
