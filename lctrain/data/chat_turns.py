"""Which text of a conversation is trained, by the rule of inference: turn k is what the model writes after
``messages[:k]`` rendered with the generation prompt.

For each trained turn k the template gives two renderings: the *prompt*, ``messages[:k]`` with the generation
prompt, and the turn as the template writes the last message, ``messages[:k + 1]``; the *completion* is what the
second adds after the first, trailing whitespace left out (ChatML's newline after ``<|im_end|>``). Most templates
write every turn of the whole conversation exactly so, and then the whole rendering is the one document, each turn
trained on its completion's characters (cost linear in the conversation's length). Some do not:

- reasoning templates (Qwen3; gpt-oss's analysis channel) drop the reasoning of earlier turns, so the whole
  rendering holds an earlier turn without what the model wrote;
- some end the last message otherwise (Phi-3.5 appends its EOS when no generation prompt is asked for, gpt-oss ends
  it with ``<|return|>`` and the history's with ``<|end|>``), so an earlier turn's completion is not what follows it
  in the whole rendering;
- some write the history otherwise once the turn is added (Mistral moves the system prompt into the last user
  message, gpt-oss drops a tool call's reasoning once an answer follows it), so the turn's rendering does not start
  with its prompt. The completion is then found where the template writes the turn: from the last text that the
  generation prompt adds before where the same messages with the turn's text fields replaced by a placeholder part
  from it.

Such a conversation is *divergent*: ``divergent_turns`` decides, ``expand`` (one document per divergent turn,
``prompt + completion``, that turn trained; the turns that agree stay trained in the whole rendering), ``last_turn``
(one document: the last trained turn at inference) or ``error``. A turn that no generation prompt leads to is
*unreachable* (QwQ and the DeepSeek-R1 distills open a think block in the generation prompt that the rendered turn
lacks): ``unreachable_turns`` is ``error`` or ``skip`` (counted).

Pure functions of the messages and a ``render(messages, generation_prompt) -> str``; ``lctrain.data.chat``
tokenizes what they return.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lctrain.data.config import DIVERGENT_TURNS, UNREACHABLE_TURNS

# the counts a plan reports beside its texts: a conversation rendered per turn, a turn left out
DIVERGENT, UNREACHABLE = "divergent", "unreachable"
_PLACEHOLDER = "\x00"  # a turn's field that no real text starts with: where the template writes the turn
_SHOWN = 24  # characters of context shown around a difference in an error

Render = Callable[[list[dict[str, Any]], bool], str]


@dataclass(frozen=True)
class TrainedText:
    """A text to tokenize and the character spans ``[a, b)`` of it that are trained (None = every character)."""

    text: str
    spans: tuple[tuple[int, int], ...] | None


@dataclass(frozen=True)
class InferenceTurn:
    """Turn ``index`` at inference: the ``prompt`` it follows and the ``completion`` the model writes."""

    index: int
    prompt: str
    completion: str

    @property
    def text(self) -> TrainedText:
        """``prompt + completion``, the completion trained."""
        start = len(self.prompt)
        return TrainedText(self.prompt + self.completion, ((start, start + len(self.completion)),))

    def agrees(self, whole: str) -> bool:
        """Whether ``whole`` starts with the prompt followed by the completion."""
        return whole.startswith(self.prompt) and whole.startswith(self.completion, len(self.prompt))


class UnreachableTurn(ValueError):
    """A turn that does not follow its generation prompt in any rendering."""


def _shared(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    return len(os.path.commonprefix([a, b]))


def _short(text: str, start: int, stop: int) -> str:
    """``text[start:stop]`` (clipped to the text) as a repr, with an ellipsis where it is cut."""
    start, stop = max(start, 0), min(stop, len(text))
    return f"{'…' if start else ''}{text[start:stop]!r}{'…' if stop < len(text) else ''}"


def difference(whole: str, expected: str) -> str:
    """Where ``whole`` first departs from ``expected`` (the text at inference), both shortened."""
    at = _shared(whole, expected)
    return (
        f"at character {at} the whole conversation renders {_short(whole, at - _SHOWN, at + _SHOWN)} where "
        f"inference renders {_short(expected, at - _SHOWN, at + _SHOWN)}"
    )


def inference_turn(render: Render, messages: Sequence[dict[str, Any]], index: int) -> InferenceTurn:
    """Turn ``index`` (an assistant message) as the model meets it at inference; ``UnreachableTurn`` when the
    template writes it without what the generation prompt opens."""
    history = list(messages[:index])
    prompt = render(history, True) if history else ""  # a conversation that opens with the assistant: all of it
    last = render([*history, messages[index]], False)
    if last.startswith(prompt):
        return InferenceTurn(index, prompt, last[len(prompt) :].rstrip())
    # The template writes the history differently when the turn ends the conversation (a system prompt moved into
    # the last user message, a tool call's reasoning dropped once an answer follows it). The turn's fields start
    # where the same messages with placeholder fields part from it (``fields``); the turn itself starts at the last
    # text the generation prompt adds (``opened``) before that point and after where ``last`` departs from the
    # history rendered alone (``departs``): the generation prompt's text, then what the model writes.
    fields = _shared(last, render([*history, _placeholders(messages[index])], False))
    alone = render(history, False)
    opened = prompt[_shared(prompt, alone) :]  # what the generation prompt adds
    departs = _shared(last, alone)
    start = last.rfind(opened, departs, fields)
    if start < 0:
        raise UnreachableTurn(
            f"its generation prompt ends {_short(prompt, len(prompt) - _SHOWN, len(prompt))} but the template "
            f"writes the turn after {_short(last, fields - _SHOWN, fields)}"
        )
    return InferenceTurn(index, prompt, last[start + len(opened) :].rstrip())


def _placeholders(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with each non-empty text field but its role (content, reasoning) replaced by ``_PLACEHOLDER``."""
    return {key: _PLACEHOLDER if key != "role" and isinstance(v, str) and v else v for key, v in message.items()}


@dataclass(frozen=True)
class TurnSettings:
    """What to do with divergent conversations and unreachable turns (``DIVERGENT_TURNS``, ``UNREACHABLE_TURNS``)."""

    divergent: str = "expand"
    unreachable: str = "error"

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("data.divergent_turns", self.divergent, DIVERGENT_TURNS),
            ("data.unreachable_turns", self.unreachable, UNREACHABLE_TURNS),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} must be one of {', '.join(allowed)}")


DEFAULT_TURNS = TurnSettings()


def _last_turn_fix(render: Render, messages: Sequence[dict[str, Any]], turns: Sequence[int], whole: str) -> str:
    """``data.train_on=last_assistant`` named as a fix when the whole rendering holds the last turn as at inference."""
    try:
        works = inference_turn(render, messages, turns[-1]).agrees(whole)
    except UnreachableTurn:
        works = False
    return ", or data.train_on=last_assistant" if works else ""


def plan_turns(
    render: Render,
    messages: Sequence[dict[str, Any]],
    turns: Sequence[int],
    settings: TurnSettings,
    *,
    where: str,
    whole: str | None = None,
    runs: Sequence[tuple[int, int]] | None = None,
) -> list[TrainedText | str]:
    """The texts that train ``turns`` (indices of assistant messages) of a conversation, with the counts
    (``DIVERGENT``, ``UNREACHABLE``) among them: ``[whole rendering]`` when it agrees with every turn at inference;
    else as ``settings`` say. ``whole``: the conversation rendered (without generation prompt), if already done;
    ``runs``: its ``{% generation %}`` character spans of ``turns``, each then trimmed to the turn's completion.
    ``ValueError`` (one line naming ``where``, the turn, the difference and the settings that fix it) otherwise."""
    whole = render(list(messages), False) if whole is None else whole
    counts: list[str] = []
    agreeing: list[tuple[int, int]] = []
    divergent: list[InferenceTurn] = []
    reachable: list[InferenceTurn] = []
    for position, index in enumerate(turns):
        try:
            turn = inference_turn(render, messages, index)
        except UnreachableTurn as error:
            if settings.unreachable == "skip":
                counts.append(UNREACHABLE)
                continue
            raise ValueError(
                f"{where}: messages[{index}] (assistant) cannot follow its generation prompt: {error}; set "
                f"data.unreachable_turns=skip to leave such turns out (counted), or data.chat_template to a template "
                f"that writes each turn after its generation prompt" + _last_turn_fix(render, messages, turns, whole)
            ) from None
        reachable.append(turn)
        if not turn.agrees(whole):
            divergent.append(turn)
            continue
        start, stop = len(turn.prompt), len(turn.prompt) + len(turn.completion)
        if runs is not None:  # the template's marks, trimmed to what the model writes
            start, stop = max(start, runs[position][0]), min(stop, runs[position][1])
        agreeing.append((start, stop))
    if not divergent:
        return [*counts, TrainedText(whole, tuple(agreeing))]
    if settings.divergent == "error":
        turn = divergent[0]
        raise ValueError(
            f"{where}: messages[{turn.index}] (assistant) is not written in the whole conversation as after its "
            f"generation prompt ({difference(whole, turn.prompt + turn.completion)}); set data.divergent_turns=expand "
            f"(one document per such turn) or last_turn" + _last_turn_fix(render, messages, turns, whole)
        )
    if settings.divergent == "last_turn":
        return [DIVERGENT, *counts, reachable[-1].text]
    return [DIVERGENT, *counts, *(turn.text for turn in divergent)] + (
        [TrainedText(whole, tuple(agreeing))] if agreeing else []
    )
