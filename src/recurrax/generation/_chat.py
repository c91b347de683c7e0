"""A chat at the terminal (`recurrax generate --chat`): the conversation's messages and the
token ids the model has consumed for them, so that a turn prefills only its new tokens."""

from __future__ import annotations


def with_system(messages: list[dict], system: str | None) -> list[dict]:
    """`messages` after a system message `system` (none when it is None)."""
    return messages if system is None else [{"role": "system", "content": system}, *messages]


class Conversation:
    """A chat's messages and the ids the model has consumed for them. The next turn's prompt
    is the template's rendering of the whole conversation; where it starts with the previous
    rendering and the reply (as it does for templates that only append), its ids are the
    previous ones, the reply's tokens as generated and the rest encoded: it extends what the
    session consumed, so only the new tokens are prefilled. Where it does not (a template
    that rewrites earlier text, a reply cut by a stop string), the rendering is encoded whole
    (a full prefill)."""

    def __init__(self, tokenizer, system: str | None, stop_tokens):
        self.tokenizer, self.stop_tokens = tokenizer, set(stop_tokens)
        self.messages = with_system([], system)
        self.text, self.ids = "", []  # the conversation rendered so far, and its ids

    def prompt(self, line: str) -> list[int]:
        """Add the user's `line`; the ids of the whole conversation, the reply to come last."""
        self.messages.append({"role": "user", "content": line})
        text = self.tokenizer.apply_chat_template(self.messages)
        if self.ids and text.startswith(self.text):
            self.ids = self.ids + self.tokenizer.encode(text[len(self.text):], add_special_tokens=False)
        else:
            self.ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.text = text
        return self.ids

    def add_reply(self, stream) -> None:
        """Add the reply `stream` (a finished `TextStream`) as the assistant's message."""
        self.messages.append({"role": "assistant", "content": stream.text})
        tokens = list(stream.tokens)
        if tokens and tokens[-1] in self.stop_tokens:
            tokens.pop()
        if self.tokenizer.decode(tokens) == stream.text:
            self.text, self.ids = self.text + stream.text, self.ids + tokens
        else:
            self.text, self.ids = "", []
