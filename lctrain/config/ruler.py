"""The ``ruler`` section of a job: the long-context task suite (RULER's needles, variable tracking and word
extraction, and a user's multiple-choice file in LongBench v2's fields) that ``lctrain eval`` scores (``eval.tasks``
with ``ruler``) and that training scores every ``ruler.every`` steps; ``lctrain.ruler`` generates and scores it.
Checked when made; what needs the model or the mesh (lengths against the model's positions and the sequence's cut)
is ``lctrain.ruler.suite.check_suite``'s. Importing this module loads neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NEEDLE_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
RULER_TASKS = (*NEEDLE_TASKS, "vt", "cwe", "fwe", "choice")
HAYSTACKS = ("noise", "corpus")


@dataclass
class RulerConfig:
    """Which tasks, at which lengths and depths, how many examples of each, and how the effective length is read."""

    # niah_single, niah_multikey, niah_multivalue, niah_multiquery (needles in the haystack), vt (variable tracking),
    # cwe (common words), fwe (frequent words), choice (the multiple-choice file choice_path)
    # (the default: a small suite, every task of which fits in 256 tokens)
    tasks: list[str] = field(default_factory=lambda: ["niah_single", "niah_multikey", "vt", "fwe"])
    lengths: list[int] = field(default_factory=list)  # tokens per example; [] = data.seq_len / 4, / 2 and data.seq_len
    depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])  # needle tasks: the needle's depth, 0 = start
    samples: int = 1  # examples per task, length (and depth, for the needle tasks)
    seed: int = 0  # every example is made from (seed, task, length, depth, index)
    haystack: str = "noise"  # the needle tasks' haystack: noise (repeated sentences) or corpus (corpus_paths' text)
    corpus_paths: list[str] = field(default_factory=list)  # txt or jsonl ("text") files; [] = the standard library's
    choice_path: str | None = None  # choice: a jsonl/json file of records with LongBench v2's fields
    chat: bool = False  # render each prompt with the tokenizer's chat template (a chat model)
    relative_threshold: float = 0.85  # effective length: score >= this x the score at the shortest length
    absolute_threshold: float | None = None  # set (e.g. 0.856, RULER's) to use this score as the threshold instead
    every: int = 0  # training: score the suite every this many steps and at the last; 0 = never
    compare: list[str] = field(default_factory=list)  # eval: earlier ruler.json files drawn beside this one's curve

    def __post_init__(self) -> None:
        unknown = [task for task in self.tasks if task not in RULER_TASKS]
        if unknown or not self.tasks or len(set(self.tasks)) < len(self.tasks):
            raise ValueError(
                f"ruler.tasks={list(self.tasks)}: lctrain has no task {', '.join(map(repr, unknown))}; give distinct "
                f"tasks among {', '.join(RULER_TASKS)}"
                if unknown
                else f"ruler.tasks={list(self.tasks)} must be distinct tasks among {', '.join(RULER_TASKS)}"
            )
        if any(length < 1 for length in self.lengths):
            raise ValueError(f"ruler.lengths={list(self.lengths)} must be positive token counts")
        if not self.depths or any(not 0.0 <= depth <= 1.0 for depth in self.depths):
            raise ValueError(
                f"ruler.depths={list(self.depths)} must be fractions in [0, 1] (0 = start of the haystack)"
            )
        if self.samples < 1:
            raise ValueError(f"ruler.samples={self.samples} must be >= 1")
        if self.haystack not in HAYSTACKS:
            raise ValueError(f"ruler.haystack={self.haystack!r} must be noise or corpus")
        if ("choice" in self.tasks) != (self.choice_path is not None):
            raise ValueError(
                f"ruler.tasks={list(self.tasks)} with ruler.choice_path={self.choice_path}: the task choice scores the "
                f"multiple-choice file ruler.choice_path; give both or neither"
            )
        if not 0.0 < self.relative_threshold <= 1.0:
            raise ValueError(f"ruler.relative_threshold={self.relative_threshold} must be in (0, 1]")
        if self.absolute_threshold is not None and not 0.0 < self.absolute_threshold <= 1.0:
            raise ValueError(f"ruler.absolute_threshold={self.absolute_threshold} must be in (0, 1] (or null)")
        if self.every < 0:
            raise ValueError(f"ruler.every={self.every} must be >= 0 (0 = never during training)")

    def suite_lengths(self, seq_len: int) -> list[int]:
        """The lengths scored, shortest first: ``lengths``, or ``seq_len`` / 4, / 2 and ``seq_len``."""
        return sorted(set(self.lengths or [seq_len // 4, seq_len // 2, seq_len]))
