"""What each token of a record is, where the data says: its chat role, and whether it is JSON, code or prose.

Verify reports KL by kind of token (docs/evidence.md, "Token kinds"); the labels are made here, from the record's
text before it is tokenized, and carried to every token through packing (``stream.Layout``).

* Roles, for chat records: the chat is rendered message by message (the template on the first k messages, for
  each k); the characters the k-th message adds to the rendering belong to it. Inside that span its content gets the
  message's role (system, user, assistant, tool; any other role name is ``other``) and the rest, the template's own
  headers and any text the template adds, is ``template`` (and has no form). In an assistant span, text from ``<think>`` to
  ``</think>`` (the mark reasoning models' templates put around the reasoning) is ``reasoning``. A template whose
  rendering of k messages is not a prefix of its rendering of k + 1 (one that rewrites earlier turns) gives its
  records no roles.
* Forms, for every text or chat record: a record (or a chat message's content) that is a JSON object or array as a
  whole is ``json``; text inside a Markdown code fence (a line starting with three backticks, to the next such
  line) is ``code``; the rest is ``prose``.

A token takes the label of the last character it covers (a token " {" is the brace's). Tokens the data did not
write (BOS, the EOS between packed records) and records of token ids have none (0). Labels need a fast tokenizer's
character offsets; with a slow tokenizer every token is unlabelled.
"""

import json
import re

ROLES = ("system", "user", "assistant", "tool", "other", "template", "reasoning")
FORMS = ("prose", "json", "code")
FORM_SHIFT = 4  # a token's code: role index + 1 in the low bits, form index + 1 above them (0: no label)
_FENCE = re.compile(r"^```.*?(?:^```[^\n]*$|\Z)", re.DOTALL | re.MULTILINE)
_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)


def role_of(code: int) -> str | None:
    """The role a token code holds, None when it has none."""
    return ROLES[(code & ((1 << FORM_SHIFT) - 1)) - 1] if code & ((1 << FORM_SHIFT) - 1) else None


def form_of(code: int) -> str | None:
    """The form a token code holds, None when it has none."""
    return FORMS[(code >> FORM_SHIFT) - 1] if code >> FORM_SHIFT else None


def _code(role: str | None, form: str | None) -> int:
    return (ROLES.index(role) + 1 if role else 0) | ((FORMS.index(form) + 1) << FORM_SHIFT if form else 0)


def _is_json(text: str) -> bool:
    """A JSON object or array as a whole (a bare number or string is prose)."""
    text = text.strip()
    if not text or text[0] not in "[{":
        return False
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _forms(text: str) -> list[str]:
    """Each character's form."""
    if _is_json(text):
        return ["json"] * len(text)
    forms = ["prose"] * len(text)
    for m in _FENCE.finditer(text):
        forms[m.start() : m.end()] = ["code"] * (m.end() - m.start())
    return forms


def text_labels(text: str) -> bytearray:
    """Each character's code for a plain-text record: a form, no role."""
    return bytearray(_code(None, f) for f in _forms(text))


def chat_labels(messages: list[dict], render) -> tuple[str, bytearray | None]:
    """The chat rendered whole, and each character's code (None when the template rewrites earlier turns).

    ``render``: the chat template on a list of messages → text (``tokenizer.apply_chat_template(m, tokenize=False)``).
    """
    text = render(messages)
    codes = bytearray(len(text))
    done = 0
    for k, message in enumerate(messages):
        upto = render(messages[: k + 1]) if k + 1 < len(messages) else text
        if not upto.startswith(text[:done]) or not text.startswith(upto):
            return text, None
        span = text[done : len(upto)]
        content = message.get("content")
        content = content if isinstance(content, str) else ""
        role = message.get("role")
        role = role if role in ROLES[:4] else "other"
        at = span.find(content) if content else -1
        roles: list[str | None] = ["template"] * len(span)
        forms: list[str | None] = [None] * len(span)  # the template's own text is neither prose nor code
        if at >= 0:
            roles[at : at + len(content)] = [role] * len(content)
            forms[at : at + len(content)] = _forms(content)
        if role == "assistant":
            for m in _THINK.finditer(span):
                roles[m.start() : m.end()] = ["reasoning"] * (m.end() - m.start())
        codes[done : len(upto)] = bytes(_code(r, f) for r, f in zip(roles, forms))
        done = len(upto)
    return text, codes


def token_codes(chars: bytearray, offsets: list[tuple[int, int]], base: int = 0) -> list[int]:
    """Each token's code from its character offsets (relative to ``base`` in ``chars``): the last character it covers."""
    out = []
    for s, e in offsets:
        i = base + (e - 1 if e > s else s)
        out.append(chars[i] if 0 <= i < len(chars) else 0)
    return out
