"""A process's /proc/<pid>/stat fields, read one way for every caller (the stage supervisor, the bench's CPU
readings, the server's resident-memory total). Linux only, as the server is."""

from __future__ import annotations

from pathlib import Path

# indexes into stat_fields(): proc(5) fields 3, 4, 9, 14, 15 and 22
STATE, PARENT, FLAGS, USER_TICKS, SYSTEM_TICKS, START_TICKS = 0, 1, 6, 11, 12, 19
# a process being torn down (killed, or exiting) has this kernel flag set long before it turns zombie: a large
# process's memory takes a while to unmap
PF_EXITING = 0x4


def stat_fields(pid: int) -> list[str] | None:
    """The fields after the command name (which may hold spaces and parentheses, hence the last ')'), or None
    when the process is gone."""
    try:
        return parse_stat(Path(f"/proc/{pid}/stat").read_bytes())
    except OSError:
        return None


def parse_stat(text: bytes, upto: int = -1) -> list[str] | None:
    """``stat_fields`` of a stat file's contents (None: not one); with ``upto``, fields 0 to ``upto`` - 1 only (the
    rest, unsplit, last: a third of the time)."""
    _, paren, fields = text.rpartition(b")")
    return fields.decode().split(None, upto) if paren else None
