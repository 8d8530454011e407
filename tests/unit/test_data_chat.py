"""Conversations -> tokens and trained-token masks: exactly the assistant's spans, for a ChatML template with
``{% generation %}`` marks (the embedded tokenizer's; its mask and the prefix method agree), the same template
without the marks (prefixes), a Llama-3-style header template (prefixes) and a Gemma-3-style template (the system
prompt written at the start of the first user turn, the assistant's role written ``model``, ``<end_of_turn>`` trained
and the newline after it not; also over the embedded chat corpus's conversations); multi-turn, a system prompt, the same
sentence in a user and an assistant turn; ``train_on``; TRL's prompt/completion pairs; bad records and templates.

The expected tokens are built by hand, independently of the template and of the prefix method: the conversation's
text as a list of (segment, trained) pieces, the whole text tokenized once, and a token trained when it overlaps a
trained segment. Each case also checks that the trained tokens decode to exactly the trained segments' text.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lctrain.data import ChatEncoder, load_tokenizer, parse_conversation
from lctrain.data.chat import token_mask
from lctrain.data.chat_turns import TurnSettings
from lctrain.data.sources import embedded_files
from lctrain.data.stdlib_chat import stdlib_conversations
from lctrain.data.tokenizer import CHAT_TEMPLATE
from testbed.corpus import GEMMA3_TEMPLATE, GEMMA3_TOKENS

PLAIN_CHATML = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
LLAMA3 = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
    "'<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
LLAMA3_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
SAME = "The answer is 42."
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": SAME},
    {"role": "assistant", "content": SAME},
    {"role": "user", "content": "Sure? Say it again."},
    {"role": "assistant", "content": "Yes: the answer is 42, surely."},
]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):  # noqa: ANN001, ANN201
    tokenizer = load_tokenizer(str(tokenizer_dir))
    tokenizer.add_tokens([*LLAMA3_TOKENS, *GEMMA3_TOKENS], special_tokens=True)
    return tokenizer


def chatml_segments(messages: list[dict], trained_turns: set[int]) -> list[tuple[str, bool]]:
    segments = [("<|bos|>", False)]
    for index, message in enumerate(messages):
        trained = index in trained_turns
        segments += [(f"<|im_start|>{message['role']}\n", False), (message["content"] + "<|im_end|>", trained)]
        segments.append(("\n", False))
    return segments


def llama3_segments(messages: list[dict], trained_turns: set[int]) -> list[tuple[str, bool]]:
    segments = [("<|bos|>", False)]
    for index, message in enumerate(messages):
        header = f"<|start_header_id|>{message['role']}<|end_header_id|>\n\n"
        segments += [(header, False), (message["content"].strip() + "<|eot_id|>", index in trained_turns)]
    return segments


def gemma3_segments(messages: list[dict], trained_turns: set[int]) -> list[tuple[str, bool]]:
    segments, system = [("<|bos|>", False)], ""
    for index, message in enumerate(messages):
        if message["role"] == "system":
            system = message["content"] + "\n\n"
            continue
        role = "model" if message["role"] == "assistant" else message["role"]
        segments.append((f"<start_of_turn>{role}\n{system}", False))
        segments += [(message["content"].strip() + "<end_of_turn>", index in trained_turns), ("\n", False)]
        system = ""
    return segments


def expected(tokenizer, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool], str]:  # noqa: ANN001
    """The tokens of the segments' text, which of them are trained, and the trained text."""
    text, spans, position = "", [], 0
    for segment, trained in segments:
        if trained:
            spans.append((position, position + len(segment)))
        text += segment
        position += len(segment)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = token_mask(np.asarray(encoded["offset_mapping"]), spans)
    return encoded["input_ids"], mask.tolist(), "".join(s for s, trained in segments if trained)


def encode(tokenizer, template: str | None, record: dict, train_on: str = "assistant", **turns: str):  # noqa: ANN001, ANN201
    encoder = ChatEncoder(tokenizer, template=template, train_on=train_on, turns=TurnSettings(**turns))
    return encoder, encoder.encode([parse_conversation(json.dumps(record), "test.jsonl:1")])[0]


def assert_document(tokenizer, document, segments) -> None:  # noqa: ANN001
    ids, mask, trained_text = expected(tokenizer, segments)
    assert document.tokens.tolist() == ids
    assert document.trained.tolist() == mask
    assert tokenizer.decode(document.tokens[document.trained]) == trained_text  # the spans are token-aligned here
    assert not document.splittable


TEMPLATES = {"chatml_marked": (None, chatml_segments), "chatml": (PLAIN_CHATML, chatml_segments)}
TEMPLATES["llama3"] = (LLAMA3, llama3_segments)
TEMPLATES["gemma3"] = (GEMMA3_TEMPLATE, gemma3_segments)


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("train_on,turns", [("assistant", {2, 4}), ("last_assistant", {4})])
def test_labels_are_exactly_the_assistant_spans(tokenizer, template: str, train_on: str, turns: set[int]) -> None:  # noqa: ANN001
    text, segments = TEMPLATES[template]
    encoder, document = encode(tokenizer, text, {"messages": CONVERSATION}, train_on)
    assert encoder.marked == (template == "chatml_marked")
    assert_document(tokenizer, document, segments(CONVERSATION, turns))
    user = tokenizer.encode(SAME, add_special_tokens=False)
    ids = document.tokens.tolist()
    copies = [i for i in range(len(ids)) if ids[i : i + len(user)] == user]
    assert len(copies) == 2 and not document.trained[copies[0] : copies[0] + len(user)].any()  # the user's copy
    assert document.trained[copies[1] : copies[1] + len(user)].all() == (2 in turns)


def test_gemma3_template_trains_the_embedded_chat_corpus_answers(tokenizer) -> None:  # noqa: ANN001
    """Every conversation of the embedded corpus's first files (with and without a system prompt, one to three
    turns) is one document under the Gemma-3-style template, each answer and its ``<end_of_turn>`` trained."""
    records = [json.loads(r["record"]) for r in stdlib_conversations(embedded_files(True, "train")[:8])]
    assert {len(r["messages"]) % 2 for r in records} == {0, 1}  # with and without a system prompt
    encoder = ChatEncoder(tokenizer, template=GEMMA3_TEMPLATE, turns=TurnSettings(divergent="error"))
    documents = encoder.encode([parse_conversation(r, f"corpus:{i}") for i, r in enumerate(records)])
    for record, document in zip(records, documents, strict=True):
        messages = record["messages"]
        assistant = {i for i, m in enumerate(messages) if m["role"] == "assistant"}
        ids, mask, _ = expected(tokenizer, gemma3_segments(messages, assistant))
        assert document.tokens.tolist() == ids and document.trained.tolist() == mask


def test_generation_marks_and_prefixes_agree(tokenizer) -> None:  # noqa: ANN001
    """The embedded template's {% generation %} mask (``return_assistant_tokens_mask``) and the prefix method on the
    same template without its marks give the same tokens and masks, for every ``train_on`` and record form."""
    records = [
        {"messages": CONVERSATION},
        {"messages": CONVERSATION[1:3]},
        {"messages": [*CONVERSATION[:2], {"role": "assistant", "content": ""}, {"role": "user", "content": "?"}]},
        {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]},
        {"messages": [{"role": "user", "content": "Call it."}, {"role": "assistant", "content": "Done."},
                      {"role": "tool", "content": "{\"ok\": true}"}, {"role": "assistant", "content": "It worked."}]},
    ]  # fmt: skip
    for record in records:
        for train_on in ("assistant", "last_assistant", "all"):
            marked, by_marks = encode(tokenizer, None, record, train_on)
            plain, by_prefixes = encode(tokenizer, PLAIN_CHATML, record, train_on)
            assert marked.marked and not plain.marked
            assert torch.equal(by_marks.tokens, by_prefixes.tokens), (record, train_on)
            assert torch.equal(by_marks.trained, by_prefixes.trained), (record, train_on)


def test_train_on_all_and_prompt_completion_pairs(tokenizer) -> None:  # noqa: ANN001
    _, everything = encode(tokenizer, None, {"messages": CONVERSATION}, "all")
    assert everything.trained.tolist() == [False] + [True] * (len(everything) - 1)  # nothing predicts the first
    # TRL's conversational pair: the prompt's assistant turn is context, the completion's is trained
    _, pair = encode(tokenizer, PLAIN_CHATML, {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]})
    assert_document(tokenizer, pair, chatml_segments(CONVERSATION, {4}))
    # TRL's plain-text pair: [BOS] prompt completion [EOS], the completion and EOS trained, no template
    _, text = encode(tokenizer, None, {"prompt": "def add(a, b):", "completion": "\n    return a + b"})
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    prompt = tokenizer.encode("def add(a, b):", add_special_tokens=False)
    completion = tokenizer.encode("\n    return a + b", add_special_tokens=False)
    assert text.tokens.tolist() == [bos, *prompt, *completion, eos]
    assert text.trained.tolist() == [False] * (1 + len(prompt)) + [True] * (len(completion) + 1)


BAD_RECORDS = {  # record (JSON text), substrings of the message
    "not_json": ('{"messages": [', ["test.jsonl:7: not valid JSON", "one JSON object per line"]),
    "not_an_object": ("[1, 2]", ["test.jsonl:7: the record is a list, not an object", '"messages"']),
    "no_messages": ('{"text": "hi"}', ["neither 'messages' nor 'prompt'/'completion'", "['text']", '"messages"']),
    "empty_messages": ('{"messages": []}', ["'messages' is not a non-empty list of messages"]),
    "no_content": ('{"messages": [{"role": "user"}]}', ["messages[0] has no 'content'", "every message needs"]),
    "no_role": ('{"messages": [{"content": "x"}]}', ["messages[0] has no 'role'"]),
    "unknown_role": (
        '{"messages": [{"role": "bot", "content": "x"}]}',
        ["messages[0] has the role 'bot'", "use one of system, developer, user, assistant, tool"],
    ),
    "list_content": (
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}',
        ["messages[0]'s content is a list, not a string", "give the content as one string"],
    ),
    "mixed_pair": ('{"prompt": "x", "completion": [{"role": "assistant", "content": "y"}]}', ["two strings"]),
}


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_bad_records_name_the_record_and_the_fix(case: str) -> None:
    record, expected_text = BAD_RECORDS[case]
    with pytest.raises(ValueError) as error:
        parse_conversation(record, "test.jsonl:7")
    message = str(error.value)
    assert message.startswith("test.jsonl:7: ") and "\n" not in message
    for text in expected_text:
        assert text in message, f"{text!r} not in {message!r}"


def test_bad_templates_name_the_record_and_the_fix(tokenizer, tokenizer_dir) -> None:  # noqa: ANN001
    record = {"messages": CONVERSATION}
    raising = "{{ raise_exception('this template takes no system message') }}"
    with pytest.raises(ValueError, match=r"test.jsonl:1: the chat template \(data.chat_template\) raised .*no system"):
        encode(tokenizer, raising, record)
    last_differs = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}[end]{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match=r"test.jsonl:1: messages\[2\] \(assistant\) is not written in the whole") as e:
        encode(tokenizer, last_differs, record, divergent="error")
    assert "data.divergent_turns=expand" in str(e.value) and "\n" not in str(e.value)
    bare = load_tokenizer(str(tokenizer_dir))
    bare.chat_template = None
    with pytest.raises(ValueError, match="has no chat template: set data.chat_template"):
        ChatEncoder(bare)
    with pytest.raises(ValueError, match="data.train_on='prompt' must be one of assistant, last_assistant, all"):
        ChatEncoder(tokenizer, train_on="prompt")
