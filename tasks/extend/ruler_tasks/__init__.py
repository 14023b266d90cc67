"""RULER's synthetic tasks as lm-eval tasks of our own: lm-eval's generators, our haystack.

``utils.dataset`` is every task's ``custom_dataset`` and ``utils.process_results`` its scorer;
``tasks/extend/ruler.py`` writes the YAMLs that name them.
"""
