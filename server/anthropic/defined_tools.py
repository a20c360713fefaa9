"""Anthropic's schema-less client tools: bash, the text editor and memory.

A client declares one of these by a versioned `type` and its fixed `name` alone, with no
`input_schema` (Anthropic's models know it); the client runs it, as any tool. A model
served here knows none of them, so each is shown to it as a function with the input
schema Anthropic documents for that version, and its calls come back as `tool_use`
blocks of that name. Server tools (web search, code execution, ...) run on Anthropic's
side and are refused (protocol.ServerTool); so is computer use, which needs a screen.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class DefinedTool:
    name: str  # the one name Anthropic accepts for the type
    description: str
    input_schema: dict[str, Any]
    takes_max_characters: bool = False  # the text editor's view limit, from 20250728 on


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required}


_PATH = {"type": "string", "description": "Absolute path of the file or directory."}
_VIEW_RANGE = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2,
               "description": "view: the first and last line to show, from 1; -1 as the "
                              "last means the end of the file."}


def _text_editor(commands: list[str]) -> dict[str, Any]:
    return _object({
        "command": {"type": "string", "enum": commands},
        "path": _PATH,
        "file_text": {"type": "string", "description": "create: the new file's content."},
        "old_str": {"type": "string",
                    "description": "str_replace: the text to replace, exactly as in the "
                                   "file and found once."},
        "new_str": {"type": "string",
                    "description": "str_replace: the text that replaces old_str; insert: "
                                   "the text to insert."},
        "insert_line": {"type": "integer",
                        "description": "insert: the line after which new_str goes (0: at "
                                       "the start)."},
        "view_range": _VIEW_RANGE,
    }, ["command", "path"])


_EDITOR_DESCRIPTION = (
    "View, create and edit text files. view shows a file with line numbers, or lists a "
    "directory; create writes a new file; str_replace replaces one exact occurrence of "
    "old_str with new_str; insert adds new_str after line insert_line.")
_EDITOR = DefinedTool("str_replace_based_edit_tool", _EDITOR_DESCRIPTION,
                      _text_editor(["view", "create", "str_replace", "insert"]))
_EDITOR_WITH_UNDO = DefinedTool(
    "str_replace_editor", _EDITOR_DESCRIPTION + " undo_edit reverts the last edit of path.",
    _text_editor(["view", "create", "str_replace", "insert", "undo_edit"]))
_BASH = DefinedTool(
    "bash", "Run a command in a persistent bash shell; restart starts a fresh shell.",
    _object({"command": {"type": "string", "description": "The command to run."},
             "restart": {"type": "boolean", "description": "Restart the shell."}}, []))
_MEMORY = DefinedTool(
    "memory",
    "A directory of memory files, /memories, kept across conversations: view a file or "
    "the directory, create a file, str_replace or insert text in one, delete or rename.",
    _object({
        "command": {"type": "string",
                    "enum": ["view", "create", "str_replace", "insert", "delete", "rename"]},
        "path": {"type": "string", "description": "A path under /memories."},
        "view_range": _VIEW_RANGE,
        "file_text": {"type": "string", "description": "create: the file's content."},
        "old_str": {"type": "string", "description": "str_replace: the text to replace."},
        "new_str": {"type": "string", "description": "str_replace: its replacement."},
        "insert_line": {"type": "integer", "description": "insert: the line after which."},
        "insert_text": {"type": "string", "description": "insert: the text to insert."},
        "old_path": {"type": "string", "description": "rename: the current path."},
        "new_path": {"type": "string", "description": "rename: the new path."},
    }, ["command"]))

DEFINED_TOOLS: dict[str, DefinedTool] = {
    "text_editor_20250728": replace(_EDITOR, takes_max_characters=True),
    "text_editor_20250429": _EDITOR,
    "text_editor_20250124": _EDITOR_WITH_UNDO,
    "text_editor_20241022": _EDITOR_WITH_UNDO,
    "bash_20250124": _BASH,
    "bash_20241022": _BASH,
    "memory_20250818": _MEMORY,
}
