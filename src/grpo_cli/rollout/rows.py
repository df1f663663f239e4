"""Row operations declared once per field: a record's dataclass fields say what they hold per row, and selecting
rows or joining records follows from that, so a field added to a Rollout, an Episodes or a Batch is carried by
every selection and every join without being named again.

    prompt_ids: torch.Tensor = per_group(pad=PAD_TOKEN, left=True)   # one row per group of G completions
    completion_ids: torch.Tensor = per_token(pad=PAD_TOKEN)          # [N, T], right-padded
    truncated: torch.Tensor = per_row()                              # [N] tensor or a list of N
    reward_errors: int = summed()                                    # added up when records are joined

A record class is declared with `@row_dataclass` (dataclasses.dataclass, with type checkers told that these helpers
declare its fields). A field with none of these (a flag, the group size, a stats dict) is the first record's. A per-row
or per-group field may be None (nothing recorded) in every record at once, and a per-row list may be empty (an episode
without an environment has no instances), never in some records and not in others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

PAD_TOKEN = "pad_token"  # the pad value of token ids: the tokenizer's, given to `join`
KIND = "rows"


def per_group(*, pad: Any = 0, left: bool = True, **kwargs):
    return dataclasses.field(metadata={KIND: "group", "pad": pad, "left": left}, **kwargs)


def per_row(**kwargs):
    return dataclasses.field(metadata={KIND: "row"}, **kwargs)


def per_token(*, pad: Any = 0, **kwargs):
    """[N, T] right-padded (a [N, T] float mask, ids, log-probs)."""
    return dataclasses.field(metadata={KIND: "token", "pad": pad, "left": False}, **kwargs)


def nested(**kwargs):
    """A record inside the record (a Batch's Rollout): selected and joined by its own fields."""
    return dataclasses.field(metadata={KIND: "nested"}, **kwargs)


def per_row_dict(**kwargs):
    """A dict of per-row values by name: lists (a reward function's scores), or records with `select(rows)` and a
    `joined(parts, lengths)` classmethod (a reward's outcomes); a name some records lack is joined as missing."""
    return dataclasses.field(metadata={KIND: "row_dict"}, **kwargs)


def summed(**kwargs):
    return dataclasses.field(metadata={KIND: "sum"}, **kwargs)


if TYPE_CHECKING:
    from typing_extensions import dataclass_transform

    _Record = TypeVar("_Record")

    # `dataclasses.dataclass` for a type checker that knows the field helpers above: without it, a field such as
    # `prompt_ids: torch.Tensor = per_group()` reads as one with a default, and a later field without one as an error
    @dataclass_transform(field_specifiers=(dataclasses.field, per_group, per_row, per_token, nested, per_row_dict,
                                           summed))
    def row_dataclass(cls: type[_Record]) -> type[_Record]: ...
else:
    row_dataclass = dataclasses.dataclass


def _kinds(record) -> list[tuple[str, str | None, Mapping[str, Any]]]:
    return [(f.name, f.metadata.get(KIND), f.metadata) for f in dataclasses.fields(record)]


def _take(value, index: list[int]):
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value[torch.tensor(index, dtype=torch.long, device=value.device)]
    return value if len(value) == 0 else [value[i] for i in index]


def select(record, rows: list[int], groups: list[int]):
    """`record` restricted to completion rows `rows` (of prompt groups `groups`, in the same order)."""
    changes = {}
    for name, kind, _ in _kinds(record):
        value = getattr(record, name)
        if kind == "group":
            changes[name] = _take(value, groups)
        elif kind in ("row", "token"):
            changes[name] = _take(value, rows)
        elif kind == "row_dict":
            changes[name] = {k: v.select(rows) if hasattr(v, "select") else _take(v, rows) for k, v in value.items()}
        elif kind == "nested":
            changes[name] = select(value, rows, groups)
    return dataclasses.replace(record, **changes)


def _padded(t: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    extra = width - t.shape[1]
    if extra <= 0:
        return t
    fill = torch.full((t.shape[0], extra), value, dtype=t.dtype, device=t.device)
    return torch.cat([fill, t] if left else [t, fill], dim=1)


def _joined(name: str, values: list, meta: Mapping[str, Any], pad_token_id: int, width: int | None):
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ValueError(f"cannot join records where {name} is recorded in some and not in others")
    if not isinstance(values[0], torch.Tensor):
        return [x for v in values for x in v]
    if values[0].dim() == 2 and meta[KIND] in ("group", "token"):
        width = width or max(v.shape[1] for v in values)
        pad = pad_token_id if meta["pad"] == PAD_TOKEN else meta["pad"]
        values = [_padded(v, width, pad, meta["left"]) for v in values]
    return torch.cat(values)


def _rows_of(record) -> int:
    """How many completion rows `record` holds (the length of its first per-row or per-token field)."""
    for name, kind, _ in _kinds(record):
        if kind in ("row", "token") and getattr(record, name) is not None and len(getattr(record, name)):
            return len(getattr(record, name))
        if kind == "nested":
            return _rows_of(getattr(record, name))
    return 0


def _joined_dicts(values: list[dict], lengths: list[int]) -> dict:
    joined = {}
    for key in dict.fromkeys(k for v in values for k in v):
        parts = [v.get(key) for v in values]
        given = next(p for p in parts if p is not None)
        if hasattr(given, "joined"):
            joined[key] = type(given).joined(parts, lengths)
        else:
            joined[key] = [x for p, n in zip(parts, lengths, strict=True) for x in (p if p is not None else [None] * n)]
    return joined


def join(records: list, pad_token_id: int, width: int | None = None):
    """One record of `records`' rows and groups, in order: prompts left-padded to the widest, every per-token field
    right-padded to one width (the widest of them all); the other fields are the first record's, summed ones
    added up."""
    first = records[0]
    if len(records) == 1:
        return first
    kinds = _kinds(first)
    width = width or max([getattr(r, name).shape[1] for r in records for name, kind, _ in kinds
                          if kind == "token" and getattr(r, name) is not None], default=None)
    changes = {}
    for name, kind, meta in kinds:
        values = [getattr(r, name) for r in records]
        if kind in ("group", "row", "token"):
            changes[name] = _joined(name, values, meta, pad_token_id, width if kind == "token" else None)
        elif kind == "row_dict":
            changes[name] = _joined_dicts(values, [_rows_of(r) for r in records])
        elif kind == "nested":
            changes[name] = join(values, pad_token_id, width)
        elif kind == "sum":
            changes[name] = sum(values)
    return dataclasses.replace(first, **changes)
