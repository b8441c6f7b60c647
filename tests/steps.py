"""A scheduled step's items as tests read them."""

from pipellm.services.compute.core.step import ScheduledStep, Work


def decodes(step: ScheduledStep) -> list:
    """The sequences the step decodes one token of."""
    return [item.seq for item in step.of(Work.DECODE)]


def chunks(step: ScheduledStep) -> list[tuple]:
    """(sequence, chunk length) of each prefill chunk."""
    return [(item.seq, item.tokens) for item in step.of(Work.PREFILL)]
