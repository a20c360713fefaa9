"""Documents a request attaches, as the text its prompt shows: Anthropic's document and
search result blocks and OpenAI's file parts (Chat Completions' `file`, the Responses
API's `input_file`).

The models here read text, so a document is read in when its data is text (a text/*
file, Anthropic's text and content sources) and shown in its message where it was sent,
in the tags Anthropic's prompting guide puts documents in: `<document>`, its title as
`<source>`, its text as `<document_content>`. A PDF or any other binary file is a 400
that says to send its text: extracting it (layout, tables, scans) is the client's to do
well, not this server's to do badly.
"""

from __future__ import annotations

from pydantic import PrivateAttr, model_validator

from server.data_urls import decode_base64, split_data_url
from server.schema import RequestModel

TEXT_CHARSET = "utf-8"


class ReadInText(RequestModel):
    """A request part read in as text once, when the request is validated, so that what
    cannot be read is a 400 naming it: `text` is how its message shows it."""

    _text: str = PrivateAttr("")

    @model_validator(mode="after")
    def _read_in(self) -> ReadInText:
        self._text = self.read_in()
        return self

    def read_in(self) -> str:
        """The part's text; ValueError if it cannot be read."""
        raise NotImplementedError

    @property
    def text(self) -> str:
        return self._text


def document(text: str, title: str | None = None, context: str | None = None) -> str:
    """How a document reads in its message."""
    parts = ["<document>"]
    if title:
        parts.append(f"<source>{title}</source>")
    if context:
        parts.append(f"<context>{context}</context>")
    parts += [f"<document_content>\n{text}\n</document_content>", "</document>"]
    return "\n".join(parts)


def search_result(source: str, title: str, text: str) -> str:
    """How a search result (a RAG tool's hit: where it is from, its title, its text) reads
    in its message."""
    return "\n".join(["<search_result>", f"<source>{source}</source>", f"<title>{title}</title>",
                      f"<content>\n{text}\n</content>", "</search_result>"])


def text_of(media_type: str, base64_data: str) -> str:
    """The text of a file sent in base64; ValueError if it is not text."""
    kind = media_type.split(";", 1)[0].strip().lower()
    if not kind.startswith("text/"):
        raise ValueError(f"{kind or 'a file without a media type'} is not read by this "
                         "server: send the document's text (a text/plain file or a text "
                         "block)")
    data = decode_base64(base64_data)
    try:
        return data.decode(TEXT_CHARSET)
    except UnicodeDecodeError as error:
        raise ValueError(f"the document is not {TEXT_CHARSET} text: {error}") from error


def text_of_data_url(url: str) -> str:
    """The text of a file sent as a `data:` URL (OpenAI's `file_data`); ValueError if it
    is not a base64 data URL of text."""
    return text_of(*split_data_url(url))
