"""The rule of inference (``lctrain.data.chat_turns``): turn k is trained as the model writes it after
``messages[:k]`` rendered with the generation prompt. Small templates of this file each reproduce one behaviour of
templates that models ship: the reasoning of earlier turns dropped (Qwen3), an EOS appended without a generation
prompt (Phi-3.5), the system prompt placed in the last user message (Mistral's tool-calling templates),
``{% generation %}`` marks around the role header (SmolLM3), a generation prompt that opens a think block the
rendered turn lacks (QwQ, the DeepSeek-R1 distills), gpt-oss's harmony format (``testbed.corpus.HARMONY_TEMPLATE``:
the history's answers without their analysis channel and ended by ``<|end|>`` where the last one ends with
``<|return|>``; a tool call's reasoning kept until an answer follows). Each expected document is written out by hand
as (text, trained) segments, independently of the templates and of the rule; then the loader: counts, and exact
resume in the middle of a conversation rendered once per turn.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest
import torch

from lctrain.attention import SequencePlace
from lctrain.data import ChatEncoder, DataConfig, PackedLoader, load_tokenizer, parse_conversation
from lctrain.data.chat_turns import DIVERGENT, UNREACHABLE, TurnSettings
from lctrain.data.packing import Document
from testbed.corpus import HARMONY_TEMPLATE, HARMONY_TOKENS, REASONING_TEMPLATE
from tests.unit.test_data_chat import CONVERSATION, PLAIN_CHATML, assert_document

GENERATION_PROMPT = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
REASONING = REASONING_TEMPLATE  # Qwen3: the turns before the last user message lose their reasoning
# Phi-3.5: the EOS after the last message when no generation prompt is asked for
EOS_APPENDED = PLAIN_CHATML.replace(
    GENERATION_PROMPT, GENERATION_PROMPT.replace("{%- endif -%}", "{%- else -%}{{- eos_token -}}{%- endif -%}")
)
# Mistral's tool-calling templates: the system prompt goes into the last user message only
SYSTEM_LAST = (
    "{{- bos_token -}}"
    "{%- if messages[0]['role'] == 'system' -%}{%- set system = messages[0]['content'] -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for m in loop_messages -%}"
    "{%- if m['role'] == 'user' and loop.last and system is defined -%}"
    "{{- '[INST]' + system + '\\n\\n' + m['content'] + '[/INST]' -}}"
    "{%- elif m['role'] == 'user' -%}{{- '[INST]' + m['content'] + '[/INST]' -}}"
    "{%- else -%}{{- m['content'] + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)
assert EOS_APPENDED != PLAIN_CHATML
# SmolLM3: the marks hold the role header and the newline after the end of the turn
MARKED_HEADER = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{% generation %}{{- '<|im_start|>assistant\\n' + m['content'] + '<|im_end|>\\n' -}}{% endgeneration %}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}" + GENERATION_PROMPT
)
# QwQ: the generation prompt opens a think block; the history keeps only the answers, the last turn all of it
OPENS_THINK = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' -}}"
    "{%- if m['role'] == 'assistant' and not loop.last -%}{{- m['content'].split('</think>')[-1].lstrip('\\n') -}}"
    "{%- else -%}{{- m['content'] -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"
)
WHY = ("Why 1\n</think>\n\n", "Why 2\n</think>\n\n")
THINKING = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Q1"},
    {"role": "assistant", "content": f"<think>\n{WHY[0]}A1"},
    {"role": "user", "content": "Q2"},
    {"role": "assistant", "content": f"<think>\n{WHY[1]}A2"},
]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):  # noqa: ANN001, ANN201
    tokenizer = load_tokenizer(str(tokenizer_dir))
    tokenizer.add_tokens(["[INST]", "[/INST]", *HARMONY_TOKENS], special_tokens=True)
    return tokenizer


def turn(role: str, content: str, trained: bool = False, end: str = "\n") -> list[tuple[str, bool]]:
    """A ChatML message as segments: the header, the content with ``<|im_end|>`` (trained or not), ``end``."""
    return [(f"<|im_start|>{role}\n", False), (content + "<|im_end|>", trained), (end, False)]


def history(messages: list[dict]) -> list[tuple[str, bool]]:
    """``<|bos|>`` and untrained ChatML messages."""
    return [("<|bos|>", False)] + [s for m in messages for s in turn(m["role"], m["content"])]


def encode(tokenizer, template: str, record: dict, train_on: str = "assistant", **turns: str):  # noqa: ANN001, ANN201
    encoder = ChatEncoder(tokenizer, template=template, train_on=train_on, turns=TurnSettings(**turns))
    return encoder.encode([parse_conversation(json.dumps(record), "chat.jsonl:3")])[0]


def assert_parts(tokenizer, parts, expected: list) -> None:  # noqa: ANN001
    """``parts`` (a list of documents and counts) against counts and segment lists."""
    assert isinstance(parts, list) and len(parts) == len(expected)
    for part, want in zip(parts, expected):
        if isinstance(want, str):
            assert part == want
        else:
            assert isinstance(part, Document)
            assert_document(tokenizer, part, want)


def test_reasoning_dropped_from_the_history_expands(tokenizer) -> None:  # noqa: ANN001
    """Turn 2 at inference holds its reasoning, the whole rendering does not: one document for turn 2, and the whole
    conversation for turn 4 (the last, which it writes as at inference)."""
    turn_2 = history(THINKING[:2]) + turn("assistant", f"<think>\n{WHY[0]}A1", trained=True, end="")
    whole = history(THINKING[:2]) + turn("assistant", "A1") + history(THINKING[3:4])[1:]
    whole += turn("assistant", f"<think>\n{WHY[1]}A2", trained=True)
    assert_parts(tokenizer, encode(tokenizer, REASONING, {"messages": THINKING}), [DIVERGENT, turn_2, whole])
    # only the last turn trained: the whole rendering agrees, one document
    last = encode(tokenizer, REASONING, {"messages": THINKING}, "last_assistant")
    assert_document(tokenizer, last, whole)
    # data.divergent_turns=last_turn: the last trained turn only, in one document; error: one line naming the fix
    assert_parts(tokenizer, encode(tokenizer, REASONING, {"messages": THINKING}, divergent="last_turn"),
                 [DIVERGENT, whole[:-1]])  # fmt: skip
    with pytest.raises(ValueError) as error:
        encode(tokenizer, REASONING, {"messages": THINKING}, divergent="error")
    message = str(error.value)
    assert message.startswith("chat.jsonl:3: messages[2] (assistant) is not written in the whole conversation")
    assert "assistant\\nA1<|im_end|>" in message and "assistant\\n<think>" in message  # the texts that differ
    for fix in ("data.divergent_turns=expand", "last_turn", "data.train_on=last_assistant"):
        assert fix in message
    assert "\n" not in message.replace("\\n", "")


def test_eos_appended_without_a_generation_prompt_expands(tokenizer) -> None:  # noqa: ANN001
    """Each turn at inference ends with the EOS the template appends after the last message: the earlier turn gets
    a document of its own, the last one is trained in the whole rendering."""
    turn_2 = history(CONVERSATION[:2]) + [
        ("<|im_start|>assistant\n", False),
        (f"{CONVERSATION[2]['content']}<|im_end|>\n<|eos|>", True),
    ]
    whole = history(CONVERSATION[:4]) + [("<|im_start|>assistant\n", False),
                                         (f"{CONVERSATION[4]['content']}<|im_end|>\n<|eos|>", True)]  # fmt: skip
    assert_parts(tokenizer, encode(tokenizer, EOS_APPENDED, {"messages": CONVERSATION}), [DIVERGENT, turn_2, whole])
    assert_document(tokenizer, encode(tokenizer, EOS_APPENDED, {"messages": CONVERSATION}, "last_assistant"), whole)
    # TRL's conversational pair trains its completion by the same rule: here the whole rendering agrees
    pair = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}
    assert_document(tokenizer, encode(tokenizer, EOS_APPENDED, pair), whole)


def test_system_prompt_in_the_last_user_message_expands(tokenizer) -> None:  # noqa: ANN001
    """At inference the system prompt sits in the user message before each turn; the whole rendering (ending with
    the assistant) has none, so no turn is trained in it: one document per turn."""
    system, same, again, answer = (CONVERSATION[i]["content"] for i in (0, 1, 3, 4))
    turn_2 = [(f"<|bos|>[INST]{system}\n\n{same}[/INST]", False), (f"{same}<|eos|>", True)]
    turn_4 = [(f"<|bos|>[INST]{same}[/INST]{same}<|eos|>[INST]{system}\n\n{again}[/INST]", False),
              (f"{answer}<|eos|>", True)]  # fmt: skip
    assert_parts(tokenizer, encode(tokenizer, SYSTEM_LAST, {"messages": CONVERSATION}), [DIVERGENT, turn_2, turn_4])
    assert_parts(tokenizer, encode(tokenizer, SYSTEM_LAST, {"messages": CONVERSATION}, "last_assistant"),
                 [DIVERGENT, turn_4])  # fmt: skip
    pair = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}  # TRL's pair: the same rule
    assert_parts(tokenizer, encode(tokenizer, SYSTEM_LAST, pair), [DIVERGENT, turn_4])
    with pytest.raises(ValueError, match=r"messages\[2\] .* set data.divergent_turns=expand .* or last_turn$"):
        encode(tokenizer, SYSTEM_LAST, {"messages": CONVERSATION}, divergent="error")  # last_assistant would not do
    # without a system prompt the whole rendering agrees: one document
    plain = CONVERSATION[1:]
    whole = [(f"<|bos|>[INST]{same}[/INST]", False), (f"{same}<|eos|>", True), (f"[INST]{again}[/INST]", False),
             (f"{answer}<|eos|>", True)]  # fmt: skip
    assert_document(tokenizer, encode(tokenizer, SYSTEM_LAST, {"messages": plain}), whole)


@pytest.mark.parametrize("train_on,trained", [("assistant", {2, 4}), ("last_assistant", {4})])
def test_marks_around_the_header_are_trimmed(tokenizer, train_on: str, trained: set[int]) -> None:  # noqa: ANN001
    """The marks hold the header and the newline after ``<|im_end|>``; only the content and ``<|im_end|>`` are
    trained, as after the generation prompt."""
    segments = [("<|bos|>", False)]
    for index, m in enumerate(CONVERSATION):
        segments += turn(m["role"], m["content"], trained=index in trained)
    assert_document(tokenizer, encode(tokenizer, MARKED_HEADER, {"messages": CONVERSATION}, train_on), segments)


def test_a_turn_the_generation_prompt_cannot_reach(tokenizer) -> None:  # noqa: ANN001
    """The generation prompt opens a think block. A turn written without one follows no generation prompt: refused
    with the fix, or left out and counted. A turn with its reasoning follows it, and the history drops the
    reasoning: expanded."""
    with pytest.raises(ValueError) as error:
        encode(tokenizer, OPENS_THINK, {"messages": CONVERSATION})
    message = str(error.value)
    assert message.startswith("chat.jsonl:3: messages[2] (assistant) cannot follow its generation prompt")
    assert "<think>" in message and "data.unreachable_turns=skip" in message and "data.chat_template" in message
    assert "last_assistant" not in message  # the last turn is unreachable too
    reasoned_last = [*CONVERSATION[:4], THINKING[4]]
    with pytest.raises(ValueError, match=r"messages\[2\] .* or data.train_on=last_assistant$"):
        encode(tokenizer, OPENS_THINK, {"messages": reasoned_last})
    only_last = (
        history(CONVERSATION[:2]) + turn("assistant", CONVERSATION[2]["content"]) + history(CONVERSATION[3:4])[1:]
    )
    only_last += [("<|im_start|>assistant\n<think>\n", False), (f"{WHY[1]}A2<|im_end|>", True), ("\n", False)]
    assert_document(tokenizer, encode(tokenizer, OPENS_THINK, {"messages": reasoned_last}, "last_assistant"), only_last)
    skipped = encode(tokenizer, OPENS_THINK, {"messages": CONVERSATION}, unreachable="skip")
    assert skipped[:2] == [UNREACHABLE, UNREACHABLE] and len(skipped) == 3 and not skipped[2].trained.any()
    turn_2 = history(THINKING[:2]) + [("<|im_start|>assistant\n<think>\n", False), (f"{WHY[0]}A1<|im_end|>", True)]
    whole = history(THINKING[:2]) + turn("assistant", "A1") + history(THINKING[3:4])[1:]
    whole += [("<|im_start|>assistant\n<think>\n", False), (f"{WHY[1]}A2<|im_end|>", True), ("\n", False)]
    assert_parts(tokenizer, encode(tokenizer, OPENS_THINK, {"messages": THINKING}), [DIVERGENT, turn_2, whole])


HARMONY_SYSTEM = "<|start|>system<|message|>Reasoning: low<|end|>"
CALL = {"type": "function", "function": {"name": "lookup", "arguments": '{"q": "answer"}'}}


def harmony_answer(answer: str, why: str | None = None) -> str:
    """What the model writes after ``<|start|>assistant`` for its last answer: the analysis channel, then the final
    channel ended by ``<|return|>``."""
    analysis = f"<|channel|>analysis<|message|>{why}<|end|><|start|>assistant" if why is not None else ""
    return f"{analysis}<|channel|>final<|message|>{answer}<|return|>"


@pytest.mark.parametrize("system_role", ["system", "developer"])
def test_harmony_history_drops_the_analysis_and_ends_with_end(tokenizer, system_role: str) -> None:  # noqa: ANN001
    """gpt-oss's format: at inference each answer is its analysis and its final channel ended by ``<|return|>``; the
    history holds the final channel only, ended by ``<|end|>``. Every earlier turn is expanded (its document ends
    with its reasoning and ``<|return|>``), the last one trained in the whole rendering; the system prompt (or the
    developer message) is the developer's instructions."""
    record = [{**m, "role": system_role} if m["role"] == "system" else dict(m) for m in THINKING]
    for m, why in zip((record[2], record[4]), WHY):
        m["content"], m["thinking"] = m["content"].split("\n\n")[-1], why.split("\n")[0]  # "A1", "Why 1"
    opening = f"{HARMONY_SYSTEM}<|start|>developer<|message|># Instructions\n\nYou are terse.<|end|>"
    opening += "<|start|>user<|message|>Q1<|end|>"
    turn_2 = [(f"{opening}<|start|>assistant", False), (harmony_answer("A1", "Why 1"), True)]
    history = f"{opening}<|start|>assistant<|channel|>final<|message|>A1<|end|><|start|>user<|message|>Q2<|end|>"
    whole = [(f"{history}<|start|>assistant", False), (harmony_answer("A2", "Why 2"), True)]
    assert_parts(tokenizer, encode(tokenizer, HARMONY_TEMPLATE, {"messages": record}), [DIVERGENT, turn_2, whole])
    assert_document(tokenizer, encode(tokenizer, HARMONY_TEMPLATE, {"messages": record}, "last_assistant"), whole)
    # without reasoning the earlier turn still differs: <|end|> in the history, <|return|> at inference
    plain = [{k: v for k, v in m.items() if k != "thinking"} for m in record]
    turn_2 = [(f"{opening}<|start|>assistant", False), (harmony_answer("A1"), True)]
    whole = [(f"{history}<|start|>assistant", False), (harmony_answer("A2"), True)]
    assert_parts(tokenizer, encode(tokenizer, HARMONY_TEMPLATE, {"messages": plain}), [DIVERGENT, turn_2, whole])
    with pytest.raises(ValueError, match=r"messages\[2\] .*<\|end\|>.*<\|return\|>.* data.train_on=last_assistant$"):
        encode(tokenizer, HARMONY_TEMPLATE, {"messages": plain}, divergent="error")
    # one exchange: one document, the reasoning and <|return|> trained
    single = encode(tokenizer, HARMONY_TEMPLATE, {"messages": record[1:3]})
    assert_document(tokenizer, single, [(f"{HARMONY_SYSTEM}<|start|>user<|message|>Q1<|end|><|start|>assistant", False),
                                        (harmony_answer("A1", "Why 1"), True)])  # fmt: skip


def test_harmony_tool_call_keeps_its_reasoning_until_the_answer(tokenizer) -> None:  # noqa: ANN001
    """A tool call's reasoning stays in the history until an answer follows: the call is trained with its reasoning
    and ``<|call|>``, and the answer after the tool's result as at inference, with the call's reasoning in its
    history; the whole rendering (the call without it) trains neither: one document per turn."""
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "thinking": "Look it up", "tool_calls": [CALL]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "It is 42.", "thinking": "Found it"},
    ]
    call = '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": "answer"}<|call|>'
    opening = f"{HARMONY_SYSTEM}<|start|>user<|message|>Q<|end|><|start|>assistant"
    turn_1 = [(opening, False), (f"<|channel|>analysis<|message|>Look it up<|end|>{call}", True)]
    result = "<|start|>functions.lookup to=assistant<|channel|>commentary<|message|>42<|end|>"
    turn_3 = [(f"{opening}<|channel|>analysis<|message|>Look it up<|end|>{call}{result}<|start|>assistant", False),
              (harmony_answer("It is 42.", "Found it"), True)]  # fmt: skip
    assert_parts(tokenizer, encode(tokenizer, HARMONY_TEMPLATE, {"messages": messages}), [DIVERGENT, turn_1, turn_3])
    assert_parts(tokenizer, encode(tokenizer, HARMONY_TEMPLATE, {"messages": messages}, "last_assistant"),
                 [DIVERGENT, turn_3])  # fmt: skip


def test_loader_counts_and_resumes_inside_an_expanded_conversation(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Conversations rendered once per turn reach the rows as the encoder makes them, are counted, and a state saved
    at every step (a document of a conversation's middle turn waiting or in progress) resumes exactly."""
    template = tmp_path / "reasoning.jinja"
    template.write_text(REASONING)
    path = tmp_path / "chat.jsonl"
    records = []
    for index in range(12):
        messages = [{"role": "user", "content": f"Question {index}?"}]
        for k in range(index % 3 + 1):
            messages += [{"role": "assistant", "content": f"<think>\nstep {k} of {index}\n</think>\n\nAnswer {k}."},
                         {"role": "user", "content": f"And then {k}?"}]  # fmt: skip
        records.append({"messages": messages[:-1]})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = DataConfig(seq_len=64, paths=[str(path)], tokenizer=str(tokenizer_dir), chat_template=str(template))
    place = SequencePlace(ring_rank=1, ring_size=2)
    loader = PackedLoader(config, place=place)
    batches = iter(loader)
    states = []
    for _ in range(10):
        next(batches)
        states.append(json.loads(json.dumps(loader.state_dict())))
    assert any(state["part"] > 0 for state in states)
    assert loader.skipped()["data"]["divergent"] == states[-1]["divergent"] > 0
    assert loader.skipped()["data"]["unreachable"] == 0
    fresh = list(islice(PackedLoader(config, place=place), 14))
    for index, state in enumerate(states):
        resumed = PackedLoader(config, place=place)
        resumed.load_state_dict(state)
        for want, batch in zip(fresh[index + 1 : index + 4], islice(resumed, 3), strict=True):
            for key in ("input_ids", "labels", "position_ids"):
                assert torch.equal(batch[key], want[key]), (index, key)
