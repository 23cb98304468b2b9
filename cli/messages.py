"""The messages of a point-to-point step (``planner.messages``) as one line for tables and
pictures."""

from __future__ import annotations

from cli.tables import format_bytes
from planner.messages import MessageSummary


def describe_messages(messages: MessageSummary) -> str:
    """``56 messages between 56 rank pairs, 8 local copies; the busiest rank sends 512 KiB, receives 512 KiB``"""
    copies = f", {messages.local_copies} local cop{'y' if messages.local_copies == 1 else 'ies'}"
    if not messages.messages:
        return f"no messages{copies}: every rank already holds what it needs"
    return (
        f"{messages.messages} message{'s' * (messages.messages != 1)} between {len(messages.pairs)} rank "
        f"pair{'s' * (len(messages.pairs) != 1)}{copies}; the busiest rank sends "
        f"{format_bytes(messages.most_sent)}, receives {format_bytes(messages.most_received)}"
    )
