"""Kept so that ``fencegate.commands.actions`` still imports: the operator's actions live in
`fencegate.operator_actions`, below both the command line and the console."""

from fencegate.operator_actions import (
    cancel_job,
    key_fields,
    key_history,
    resolve_key,
    retry_job,
    stored_answer,
)

__all__ = ["cancel_job", "key_fields", "key_history", "resolve_key", "retry_job", "stored_answer"]
