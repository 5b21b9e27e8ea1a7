"""The boxes a ``torch.distributed.pipelining`` schedule runs on one stage, recorded from the
schedule's own step loop, with no process group: the reference of exercise 04b.3.

Taught in notebooks/04b_pipeline_schedules.ipynb (exercise 04b.3, the 1F1B order). Follows
torch 2.14.1's ``torch/distributed/pipelining/schedules.py`` and its
``_schedule_visualizer.get_schedule_ops``, which builds schedules on a
``mock.create_autospec(PipelineStage)`` stage in the same way. The schedule's
``pipeline_order`` (the plan that visualiser draws) is computed apart from the loop that runs, and
in torch 2.14.1 ``Schedule1F1B``'s numbers the last stage's forwards from 1 and ignores m < p; so
this module runs ``_step_microbatches`` itself, on a mock stage that records each
``forward_one_chunk`` and ``backward_one_chunk`` and whose sends and receives are empty.
"""

from __future__ import annotations

from unittest import mock

from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def recorded_order(
    schedule: str, stage: int, num_stages: int, n_microbatches: int
) -> list[tuple[str, int]]:
    """The boxes stage ``stage`` of ``num_stages`` runs in one step of ``schedule`` ("gpipe":
    ``ScheduleGPipe``, "1f1b": ``Schedule1F1B``) with ``n_microbatches`` micro-batches, in order,
    as ``("forward", i)`` / ``("backward", i)``: what the schedule's ``_step_microbatches`` calls.

    ``Schedule1F1B`` refuses m < p when it is built (its check, not its loop: the loop's warm-up
    is ``min(n_microbatches, num_stages - stage_index)``); for m < p the schedule is built for
    m = p and its loop then given m micro-batches, so the order recorded is what that loop runs.

    Raises:
        ValueError: ``schedule`` is not "gpipe" or "1f1b", or a count is below 1 or the stage
            outside 0 … p − 1.
    """
    if schedule not in CLASSES:
        raise ValueError(f"schedule={schedule!r}: give one of {sorted(CLASSES)}")
    if n_microbatches < 1 or num_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(
            f"stage={stage}, num_stages={num_stages}, n_microbatches={n_microbatches}: give "
            "at least one stage and one micro-batch, and a stage from 0 to num_stages − 1"
        )
    boxes: list[tuple[str, int]] = []
    st = mock.create_autospec(PipelineStage, instance=True)
    st.num_stages, st.stage_index, st.submod = num_stages, stage, None
    st.is_first, st.is_last = stage == 0, False  # no loss to compute: the order is the same
    for ops in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
        getattr(st, ops).return_value = []  # nothing to send or receive
    st.forward_one_chunk.side_effect = lambda i, *args, **kw: boxes.append(("forward", i))
    st.backward_one_chunk.side_effect = lambda i, *args, **kw: boxes.append(("backward", i))
    sched = CLASSES[schedule](st, max(n_microbatches, num_stages))
    sched._n_microbatches = n_microbatches
    sched._initialize_stage = lambda *args, **kw: None  # shape inference needs real ranks
    sched._step_microbatches([()] * n_microbatches, [{}] * n_microbatches)
    return boxes
