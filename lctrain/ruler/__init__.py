"""The long-context task suite: RULER's needles, variable tracking and word extraction, and a multiple-choice file in
LongBench v2's fields, generated from the model's tokenizer (``tasks.py``, ``choice.py``; the pieces: ``prompt.py``,
``example.py``, ``haystack.py``; the whole suite: ``suite.py``), and its table, effective length and curve
(``report.py``). ``lctrain.train.ruler_score`` scores it on the job's mesh; see ``docs/evaluation.md``.
"""
