"""Where a tool result's images go in the prompt (an Anthropic
``tool_result`` that holds ``image`` blocks: a screenshot tool, an image
file read).

Chat templates differ: Qwen3.5's (and Qwen3-VL's) write an image part of a
tool message inside its ``<tool_response>``, where it is; Gemma 3's refuses
a tool message at all (roles must alternate user / model). So the chat
messages are laid out the first of three ways the template renders with the
images written (``LAYOUTS``):

- ``in_place``: the tool message holds its images;
- ``images_after``: the tool messages keep their text, and each run of them
  is followed by a user turn holding their images (the next user message,
  when one follows);
- ``as_user``: every tool message is a user turn (its text, then its
  images), merged with the user turns beside it.

Each keeps the images in the order they were sent: the processor pairs the
template's markers with the images in order.
"""

from __future__ import annotations

from typing import Callable


def holds_tool_images(messages: list[dict]) -> bool:
    return any(m["role"] == "tool" and _images(m["content"]) for m in messages)


def in_place(messages: list[dict]) -> list[dict]:
    return messages


def without_tool_images(messages: list[dict]) -> list[dict]:
    """The tool messages' images left out: what a template that drops them writes."""
    return [{**m, "content": _text(m["content"])} if m["role"] == "tool" else m
            for m in messages]


def images_after(messages: list[dict]) -> list[dict]:
    out, moved = [], []
    for m in messages:
        if m["role"] == "tool":
            moved += _images(m["content"])
            out.append({**m, "content": _text(m["content"])})
            continue
        if moved:
            if m["role"] == "user":  # the images open the user turn that follows
                m = {**m, "content": moved + _parts(m["content"])}
            else:
                out.append({"role": "user", "content": moved})
            moved = []
        out.append(m)
    if moved:
        out.append({"role": "user", "content": moved})
    return out


def as_user(messages: list[dict]) -> list[dict]:
    out, merging = [], False  # merging: the last turn out holds a tool result
    for m in messages:
        tool = m["role"] == "tool"
        if tool:
            m = {"role": "user", "content": m["content"]}
        if m["role"] == "user" and out and out[-1]["role"] == "user" and (tool or merging):
            out[-1] = {"role": "user",
                       "content": _parts(out[-1]["content"]) + _parts(m["content"])}
        else:
            out.append(m)
        merging = out[-1]["role"] == "user" and (tool or merging)
    return out


LAYOUTS: tuple[Callable[[list[dict]], list[dict]], ...] = (in_place, images_after, as_user)


def rendered(render: Callable[[list[dict]], str], messages: list[dict]) -> str:
    """``render``'s text (the chat template's) for ``messages`` in the first
    layout it takes with the tool messages' images written: in place when
    its text differs from the text without them. Raises the first layout's
    error when none renders."""
    if not holds_tool_images(messages):
        return render(messages)
    refused = None
    for layout in LAYOUTS:
        try:  # jinja errors, e.g. roles the template refuses
            text = render(layout(messages))
            if layout is not in_place or text != render(without_tool_images(messages)):
                return text
        except Exception as e:
            refused = refused or e
    raise refused


def _parts(content) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return list(content)


def _images(content) -> list[dict]:
    return [p for p in _parts(content) if p["type"] == "image"]


def _text(content) -> str:
    return "".join(p["text"] for p in _parts(content) if p["type"] == "text")
