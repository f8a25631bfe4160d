"""A chat request's messages on the wire: their content as text or as
parts (text, and images as ``image_url`` parts). Apart from
``openai_schema.py``, which validates the rest of a request."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictStr


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: StrictStr
    detail: Optional[StrictStr] = None  # accepted; the model's processor decides the size


class ImagePart(BaseModel):
    """``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``
    (or an http(s) URL; some clients send the URL as a bare string)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url"]
    image_url: Union[StrictStr, ImageURL]
    # Where the part is on the wire of the API it came from (the Anthropic
    # and Responses translations set it): the param of its errors.
    source_param: Optional[StrictStr] = None

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[StrictStr, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's earlier calls
    tool_call_id: Optional[StrictStr] = None  # the call a tool message answers

    def text(self) -> str:
        """The message's text (its images left out)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def images(self, i: int) -> list[tuple[str, ImagePart]]:
        """The image parts of the request's message ``i``, each with its
        param (where it is on the client's wire)."""
        if not isinstance(self.content, list):
            return []
        return [(part.source_param or f"messages.{i}.content.{j}", part)
                for j, part in enumerate(self.content) if isinstance(part, ImagePart)]

    def template_content(self) -> list[dict]:
        """The parts as chat templates take them: ``{"type": "text", "text"}``
        and ``{"type": "image"}``, where the template writes its image marker."""
        return [{"type": "text", "text": part.text} if isinstance(part, TextPart)
                else {"type": "image"} for part in self.content or []]
