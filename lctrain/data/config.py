"""What a job reads and how it packs it: the ``data`` section of ``lctrain.config.JobConfig``, each field documented
and checked where it is defined. Importing this module loads neither torch nor ``datasets``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

DATA_FORMATS = ("auto", "text", "chat", "preference")
TRAIN_ON = ("assistant", "last_assistant", "all")
OVERLONG = ("drop", "truncate", "error")
DIVERGENT_TURNS = ("expand", "last_turn", "error")
UNREACHABLE_TURNS = ("error", "skip")


@dataclass
class SourceConfig:
    """One source of ``data.sources`` (a mixture) or ``data.val_sources`` (held-out data). Set ``paths`` or
    ``dataset``; with neither, the embedded corpus of its format and ``split``. ``DataConfig`` checks it (its
    errors name the source by its place in the list)."""

    name: str = ""  # names the source in the metrics (loss/<name>) and errors; required, unique
    paths: list[str] = field(default_factory=list)  # local jsonl/json, parquet or txt files; globs allowed
    dataset: str | None = None  # a hub dataset name (needs network)
    dataset_config: str | None = None  # the hub dataset's configuration name
    split: str = "train"  # the hub dataset's split; for the embedded corpus: train or validation
    weight: float = 1.0  # share of the documents drawn (relative to the other sources' weights), > 0
    format: str | None = None  # text, chat, preference or auto; None = data.format
    text_field: str | None = None  # the field holding a text document; None = data.text_field


@dataclass
class DataConfig:
    """What to read and how to pack it. Set ``paths`` or ``dataset``, or ``sources`` (a mixture); with none, the
    embedded default corpus. The settings are checked when the config is made (no file is read): one
    ``ValueError`` naming the setting and the fix; ``lctrain.data.check_data`` checks them against the files."""

    seq_len: int = 4096  # tokens per packed row (global, before context-parallel sharding)
    batch_size: int = 1  # rows per micro-batch
    paths: list[str] = field(default_factory=list)  # local jsonl/json, parquet or txt files; globs allowed
    dataset: str | None = None  # a hub dataset name (needs network)
    dataset_config: str | None = None  # the hub dataset's configuration name, if it has several
    split: str = "train"  # the hub dataset's split
    text_field: str = "text"  # the field of each record that holds the document text
    tokenizer: str | None = None  # a local tokenizer directory; None = model.path's (the trainer) or the embedded one
    shuffle_buffer: int = 0  # documents in the shuffle buffer; 0 = no shuffling
    seed: int = 0  # shuffle seed
    truncate: bool = False  # drop the rest of a document that does not fit in its row, instead of continuing it
    # text, chat (conversations), preference (pairs: prompt, chosen, rejected) or auto (by a source's first record:
    # chat when it has messages or prompt and completion, preference when it has chosen and rejected)
    format: str = "auto"
    chat_template: str | None = None  # a Jinja chat template file; None = the tokenizer's own
    train_on: str = "assistant"  # chat tokens with loss: assistant (every assistant turn), last_assistant or all
    # a conversation or preference pair longer than seq_len: drop (counted in the log), truncate (a conversation's
    # end; a pair's prompt from its start) or error
    overlong: str = "drop"
    # preference pairs: the prompt packed once, each answer seeing it as a shared prefix; false = two plain
    # documents [prompt, chosen] and [prompt, rejected] (the same loss, the prompt computed twice)
    share_prompt: bool = True
    # a conversation whose whole rendering is not what the model sees at inference for a trained turn: expand (one
    # document per such turn, counted), last_turn (only the last trained turn) or error
    divergent_turns: str = "expand"
    unreachable_turns: str = "error"  # a turn no generation prompt leads to (reasoning templates): error or skip
    sources: list[SourceConfig] = field(default_factory=list)  # a mixture, drawn by weight; [] = paths/dataset
    val_sources: list[SourceConfig] = field(default_factory=list)  # held-out data scored every train.val_every steps
    # a directory written by `lctrain prepare`: the training sources it holds (by name) are read from it, tokenized
    # already; the others (and data.val_sources) from their files. prepare writes it
    prepared: str | None = None
    prepare_workers: int = 0  # `lctrain prepare`'s worker processes; 0 = one per core

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("data.format", self.format, DATA_FORMATS),
            ("data.train_on", self.train_on, TRAIN_ON),
            ("data.overlong", self.overlong, OVERLONG),
            ("data.divergent_turns", self.divergent_turns, DIVERGENT_TURNS),
            ("data.unreachable_turns", self.unreachable_turns, UNREACHABLE_TURNS),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} must be one of {', '.join(allowed)}")
        if self.prepare_workers < 0:
            raise ValueError(f"data.prepare_workers={self.prepare_workers} must be >= 0 (0 = one per core)")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size={self.batch_size} must be >= 1")
        if self.sources and (self.paths or self.dataset):
            raise ValueError(
                "data.sources and data.paths (or data.dataset) are both set: list every source in data.sources "
                "(data.paths is the one-source form)"
            )
        _check_sources("data.sources", self.sources)
        _check_sources("data.val_sources", self.val_sources)


def _check_sources(setting: str, sources: list[SourceConfig]) -> None:
    names = [source.name for source in sources]
    for index, source in enumerate(sources):
        where = f"{setting}[{index}]"
        if not source.name:
            raise ValueError(f"{where} has no name: give each source a name (it names its metrics, loss/<name>)")
        if names.count(source.name) > 1:
            raise ValueError(f"{setting} has two sources named {source.name!r}: give each a name of its own")
        if source.paths and source.dataset:
            raise ValueError(f"{where} ({source.name}) sets paths and dataset: set one")
        if source.format is not None and source.format not in DATA_FORMATS:
            raise ValueError(f"{where}.format={source.format!r} must be one of {', '.join(DATA_FORMATS)}")
        if not source.weight > 0:
            raise ValueError(
                f"{where}.weight={source.weight} ({source.name}) must be > 0: weights are shares of the documents "
                f"drawn; leave a source out instead"
            )


def data_sources(config: DataConfig) -> list[SourceConfig]:
    """The sources of the training data, each with its format and text field: ``data.sources``, or the one source
    of ``data.paths`` / ``data.dataset`` (named ``data``)."""
    sources = config.sources or [
        SourceConfig("data", list(config.paths), config.dataset, config.dataset_config, config.split)
    ]
    return [filled_source(source, config) for source in sources]


def filled_source(source: SourceConfig, config: DataConfig) -> SourceConfig:
    """``source`` with the ``data.*`` defaults of the fields it leaves unset (``format``, ``text_field``)."""
    return replace(source, format=source.format or config.format, text_field=source.text_field or config.text_field)
